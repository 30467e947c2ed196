"""bf16 kernels for decode on the CPU (csrc/bf16_gemv.c): matrix-vector products for
one-sequence steps, and the experts of decode batches on AMX.

A single-sequence decode step reads every weight it uses once, so it runs at the speed the
GEMVs stream memory. ATen's bf16 GEMV reaches 5-9 GB/s on expert-sized matrices here (one
core, a float32 conversion per weight); these AVX512-BF16 loops reach 15-30 GB/s. The C file
is compiled with the system C compiler on first use (about a second) into the cache folder
and loaded with ctypes: a torch C++ extension would take a minute to build on two cores.

Decode batches' MoE layers run on AMX tiles (moe_batch): several tokens per expert are
compute-bound, and vdpbf16ps issues only every other cycle on these CPUs.

Where the CPU lacks AVX512-BF16, no C compiler (gcc 11+, for the AMX intrinsics) is
installed, or MOESERVE_BF16_KERNELS=0, `enable()` returns False and callers keep ATen's
kernels; without AMX, decode batches keep oneDNN's batched matmuls.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

from inference.demo_model import cache_root

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "bf16_gemv.c"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared", "-fPIC"]
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(source: bytes, target: Path) -> None:
    """Compile into a temporary file and rename it into place, so processes building at
    the same time never load a half-written library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-x", "c", "-", "-o", tmp, "-lm"], input=source, check=False,
                              capture_output=True, timeout=120)
        if done.returncode:
            raise RuntimeError(done.stderr.decode(errors="replace").strip()[-500:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MOESERVE_BF16_KERNELS", "1") == "0":
        log.info("bf16 gemv kernels off (MOESERVE_BF16_KERNELS=0); using ATen's")
        return None
    if platform.machine() != "x86_64" or "avx512_bf16" not in _cpu_flags():
        log.info("bf16 gemv kernels off: the CPU lacks AVX512-BF16; using ATen's")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"bf16_gemv-{key}.so"
    try:
        if not path.exists():
            _build(source, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("bf16 gemv kernels off: build failed; using ATen's", error=str(exc))
        return None
    lib.bf16_gemv.argtypes = [_P, _P, _P, _I64, _I64, _INT]
    lib.bf16_moe_token.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _INT]
    lib.bf16_moe_batch.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _INT]
    lib.bf16_gemv.restype = lib.bf16_moe_token.restype = None
    lib.bf16_moe_batch.restype = ctypes.c_int
    lib.bf16_amx_init.restype = ctypes.c_int
    return lib


# Set by enable(); plain bools so compiled graphs read them as constants. ACTIVE: the
# AVX512-BF16 kernels (single-row GEMVs, one-token MoE layers); AMX: moe_batch too.
ACTIVE = False
AMX = False


@functools.cache
def _amx_ready() -> bool:
    lib = _library()
    if lib is None or not {"amx_tile", "amx_bf16"} <= _cpu_flags():
        return False
    if not lib.bf16_amx_init():
        log.info("AMX expert kernel off: the kernel refused AMX state (arch_prctl)")
        return False
    return True


def enable() -> bool:
    """Build or load the kernels once (engines on the CPU in bf16 call this at start-up);
    True when single-row bf16 GEMVs and one-token MoE layers will use them."""
    global ACTIVE, AMX
    ACTIVE = _library() is not None
    AMX = ACTIVE and _amx_ready()
    return ACTIVE


def applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the AVX512-BF16 kernels can take activations x with these weights: enabled,
    bf16 on the CPU, weights contiguous (the kernels read rows with a fixed stride)."""
    if not (ACTIVE and x.device.type == "cpu" and x.dtype == torch.bfloat16):
        return False
    for w in weights:
        if w.dtype != torch.bfloat16 or not w.is_contiguous():
            return False
    return True


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bf16, contiguous) @ x [K] -> [N], bf16 with float32 accumulation."""
    n, k = weight.shape
    x = x.contiguous()
    y = x.new_empty(n)
    _library().bf16_gemv(weight.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    return y


def moe_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """One token's routed experts: x [D], w13 [E, 2I, D], w2 [E, D, I] (bf16, contiguous),
    expert ids [A] and router weights [A] -> sum over a of weights[a] * w2[a] (silu(gate) * up)
    as [D] bf16."""
    a, (d, i) = ids.numel(), w2.shape[1:]
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = x.new_empty(d)
    scratch = torch.empty(a * (2 * i + d), dtype=torch.float32)
    hidden = x.new_empty(a * i)
    _library().bf16_moe_token(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(),
                              weights.data_ptr(), a, i, d, out.data_ptr(), scratch.data_ptr(),
                              hidden.data_ptr(), torch.get_num_threads())
    return out


def moe_batch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of a decode batch on AMX (only where `AMX`): x [T, D], w13
    [E, 2I, D], w2 [E, D, I] (bf16, contiguous, D and I multiples of 32), expert ids and
    router weights [T, A] -> [T, D], each token's sum over its experts of weight * w2 (silu(gate)
    * up)."""
    t, d = x.shape
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = x.new_empty(t, d)
    if _library().bf16_moe_batch(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(), weights.data_ptr(), t,
                                 ids.shape[1], w13.shape[0], w2.shape[2], d, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("bf16_moe_batch could not allocate its buffers")
    return out


# The kernels as operators, for compiled decode graphs (eager code calls the functions
# directly: an operator dispatch costs ~8 us per call).
@torch.library.custom_op("moeserve::bf16_gemv", mutates_args=())
def gemv_op(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return gemv(weight, x)


@gemv_op.register_fake
def _(weight, x):
    return x.new_empty(weight.shape[0])


@torch.library.custom_op("moeserve::bf16_moe_token", mutates_args=())
def moe_token_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    return moe_token(x, w13, w2, ids, weights)


@moe_token_op.register_fake
def _(x, w13, w2, ids, weights):
    return x.new_empty(w2.shape[1])
