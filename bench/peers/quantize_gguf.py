"""Run llama.cpp's own quantizer on a GGUF: `llama_model_quantize` with its default parameters,
the function llama.cpp's `llama-quantize SRC DST TYPE THREADS` tool runs, through
llama-cpp-python's bindings. Runs in the llamacpp peer venv:

    python quantize_gguf.py SRC.gguf DST.gguf Q4_K_M [THREADS]

TYPE is a llama.cpp file type as its quantize tool names it (Q8_0, Q4_0, Q4_K_M, ...). Tensors
whose rows do not split into a K-quant's 256-value super-blocks get llama.cpp's own fallback
type (SmolLM2's 576-wide rows: Q5_0 under Q4_K_M), as with the tool.
"""

from __future__ import annotations

import ctypes
import sys


def quantize(src: str, dst: str, ftype_name: str, threads: int) -> None:
    import llama_cpp as L

    ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{ftype_name.upper()}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no file type {ftype_name!r}")
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({ftype_name}) returned {rc}")


if __name__ == "__main__":
    src, dst, ftype_name = sys.argv[1:4]
    quantize(src, dst, ftype_name, int(sys.argv[4]) if len(sys.argv) > 4 else 0)
