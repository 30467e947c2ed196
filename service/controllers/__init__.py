"""HTTP controllers: OpenAI-compatible generation, tokenizer utilities, probes."""
