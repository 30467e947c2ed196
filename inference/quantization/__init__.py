"""8-bit formats and their torch arithmetic: QWeight (int8 W8A8, fp8) and the block Hadamard
rotation both 8-bit formats store their values in."""
