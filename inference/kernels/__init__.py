"""Our CPU kernels: the C sources (csrc/), their ctypes binding (cpu.py: built per instruction set,
chosen by the CPU's flags) and the model's modules on them (modules.py)."""
