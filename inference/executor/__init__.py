"""Everything between a loaded config and a ready step function: building the model, loading and
converting its weights, quantizing, installing a backend, allocating the paged KV cache, and the
model runner and sampler that run each step (ModelExecutor, executor.py)."""
