"""The model files, in plain torch: one file per architecture family, the layers they share, and
the registry (architecture -> Family). No backend, quantization or scheduling here: the executor
applies those from outside."""
