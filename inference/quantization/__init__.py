"""Quantized formats and their torch arithmetic: QWeight (int8 W8A8, int4 W4A8, fp8) and the
block Hadamard rotation int8 and int4 store their values in."""
