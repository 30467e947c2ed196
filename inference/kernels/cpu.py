"""The engine's own bf16 CPU kernels (csrc/): linear layers, whole MoE layers, decode attention
over the paged cache, RMSNorm with the residual add, rotary embeddings with the cache write,
and a decode step of every layer in one call.

ATen's bf16 kernels are fast only where the CPU has AVX512-BF16 (oneDNN): on an AVX2 CPU a
bf16 batched matmul runs 100x slower than float32, and even on AVX-512 ones single-row
products stream memory at a third of its bandwidth. These kernels widen bf16 to float32 in
registers and use float32 FMAs, so one source serves every x86 CPU from AVX2 up.

The instruction set is chosen from the CPU's reported flags (`runnable_isas`), never assumed.
The C files are compiled once per instruction set ("avx2": AVX2 + FMA; "avx512": AVX-512
F/BW/DQ/VL; "avx512bf16": the same with vdpbf16ps tiles) with the system C compiler on first
use (seconds, cached under the cache folder), and only a build this CPU can run is loaded.
AMX (Sapphire Rapids and later) is a separate object (csrc/amx.c) that the AVX-512 build
hands products of many rows to, loaded only where the CPU reports AMX and Linux grants its
state (arch_prctl). A CPU with neither AVX2 nor AVX-512 (or aarch64), MOESERVE_BF16_KERNELS=0,
or no C compiler: ATen's kernels, with a log line saying so. MOESERVE_AMX=0 keeps the
AVX-512 kernels without AMX.

Weights the kernels read are prepacked once at load (`pack_weight`): a packed weight has one
dimension more than its matrix ([K/2, N, 2] for [N, K]), so it can never be mistaken for a
row-major one, and lies in huge pages (huge_pages.py); kernels/modules.py's modules hold them.
8-bit weights (quant.QWeight: int8, fp8) pack into input quads ([Kq/4, N, 4] bytes,
`pack_qweight`), the layout VNNI and AMX's int8 tiles read. int8 products (W8A8) run on AMX
int8 tiles, VNNI (csrc/int8_vnni.c, its own library where the CPU has AVX512-VNNI or AVX-VNNI)
or vpmaddubsw (every build), all exact integer sums; fp8 runs weight-only. int4 weights (W4A8)
and mxfp4 ones pack two values a byte ([Kp/8, N, 4], `pack_qweight`: int4's levels with their
zero points, mxfp4's e2m1 codes) for csrc/int4.c, a library per path (AVX512-VNNI, AVX-VNNI, or
AVX2's vpmaddubsw), chosen as int8's is (INT4); where int8 takes AMX, the AMX object's
csrc/amx_int4.c runs the products of many rows on int8 tiles and hands the rest to that path
(INT4 "amx"). The linear layer calls them directly and the MoE kernel and the one-call decode
step through the products of a block handed to the main library (ms_set_int4), where the inputs
are whole octets; their activation rows are rotated where the weights' are (unrotated:
published checkpoints).

The paged KV cache may hold 8-bit or int4 rows (KV_KINDS): the rope kernel quantizes as it writes
and decode attention dequantizes as it reads.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from inference.config import cache_root
from inference.kernels import huge_pages
from inference.models.paged_cache import INT4, kv_width, reads_alone
from inference.quantization import qweight as quant
from inference.quantization.qweight import QWeight

log = structlog.get_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]
# Flags per build, and the /proc/cpuinfo flags a CPU must report to run it.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-DMS_AVX512"]
_AVX512_CPU = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"}
BUILDS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "avx512": (_AVX512, _AVX512_CPU),
    # every CPU with AVX512-BF16 has AVX512-VNNI too (Cooper Lake, Sapphire Rapids, Zen 4)
    "avx512bf16": (
        [*_AVX512, "-mavx512bf16", "-mavx512vnni", "-DMS_AVX512_BF16", "-DMS_AVX512_VNNI"],
        _AVX512_CPU | {"avx512_bf16", "avx512_vnni"},
    ),
}
# Best first. CPUs with AMX take "avx512" (FMA tiles on widened weights, AMX for many rows)
# over "avx512bf16": the Xeons we measured issue vdpbf16ps every other cycle, half the
# products per second of float32 FMAs; AMD's Zen 4 and later run it at full rate.
PREFERENCE = ("avx512bf16", "avx512", "avx2")
_AMX_FLAGS = ["-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16", "-mamx-int8"]
_AMX_CPU = {"amx_tile", "amx_bf16", "avx512f", "avx512bw"}
# The VNNI library for each build: the build's flags plus the extension, and the CPU flag.
_VNNI = {
    "avx512": (["-mavx512vnni"], "avx512_vnni"),
    "avx512bf16": (["-mavx512vnni"], "avx512_vnni"),
    "avx2": (["-mavxvnni"], "avx_vnni"),
}
# The int4 products (csrc/int4.c), a library per path: flags and the CPU flags it needs.
_INT4 = {
    "vnni": ([*_AVX512, "-mavx512vnni"], _AVX512_CPU | {"avx512_vnni"}),
    "avxvnni": (
        [*BUILDS["avx2"][0], "-mavxvnni", "-DMS_INT4_VNNI"],
        BUILDS["avx2"][1] | {"avx_vnni"},
    ),
    "avx2": BUILDS["avx2"],
}
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU as Linux reports them (the kernel clears the
    AVX-512 ones when the OS does not save their registers)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas() -> list[str]:
    """The kernel builds this CPU can run, best first for it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    runnable = [isa for isa in PREFERENCE if BUILDS[isa][1] <= cpu_flags()]
    if _AMX_CPU <= cpu_flags() and "avx512bf16" in runnable:
        runnable.remove("avx512bf16")
        runnable.insert(runnable.index("avx512") + 1, "avx512bf16")
    return runnable


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return compiler


# The kernel library's sources; amx.c is built on its own.
KERNEL_SOURCES = (
    "hooks.c",
    "region.c",
    "hadamard.c",
    "gemm.c",
    "gemm8.c",
    "wmat.c",
    "kv_rows.c",
    "linear.c",
    "moe.c",
    "attention.c",
    "prefill_attention.c",
    "norm_rope.c",
    "embed.c",
    "greedy.c",
    "logits.c",
    "layer.c",
)


def _run_compiler(args: list[str]) -> None:
    # the timeout only guards against a hung compiler: SIMDe's emulated builds take minutes on
    # a busy 2-core machine
    done = subprocess.run(args, check=False, capture_output=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr.decode(errors="replace").strip()[-800:])


def _build(
    sources: list[Path],
    flags: list[str],
    name: str,
    variants: Sequence[tuple[Path, list[str]]] = (),
) -> Path:
    """Compiles `sources` (with the headers beside them) into the kernel cache, once per content
    of the C folder and set of flags (the common ones too); a temporary file renamed into
    place, so processes building at the same time never load a half-written library. Each
    source is compiled on its own core, then linked. `variants`: sources compiled once more
    with flags of their own added (another copy of a kernel, renamed by those flags)."""
    text = b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()) if p.suffix in (".c", ".h"))
    every_flag = [*_COMMON_FLAGS, *flags]  # a changed common flag builds anew too
    units = [(source, []) for source in sources] + list(variants)
    spelled = " ".join(every_flag + [f"{s.name}:{' '.join(f)}" for s, f in variants])
    key = hashlib.sha256(text + spelled.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [f"{work}/{i}-{source.stem}.o" for i, (source, _) in enumerate(units)]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            compiles = [
                [compiler, *every_flag, *extra, f"-I{_CSRC}", "-c", str(source), "-o", obj]
                for (source, extra), obj in zip(units, objects, strict=True)
            ]
            list(pool.map(_run_compiler, compiles))
        library = f"{work}/{name}.so"
        _run_compiler([compiler, *every_flag, *objects, "-o", library, "-lm"])
        os.replace(library, target)
    return target


class WMat(ctypes.Structure):
    """A packed weight as the kernels take it (csrc/kernels.h wmat): bf16 pairs, or 8-bit
    quads with float32 scales per (group, column) and, for int8, column sums; or 4-bit octets
    with scales, int4's zero points (NULL: symmetric), whether their rows are plain
    (unrotated) and an act-order weight's input order (int32 [..., K]; NULL: in order)."""

    _fields_ = [
        ("data", _P),
        ("scale", _P),
        ("colsum", _P),
        ("group", _I64),
        ("kind", _I64),
        ("zero", _P),
        ("plain", _I64),
        ("perm", _P),
    ]


class MoeGlu(ctypes.Structure):
    """gpt-oss's experts as ms_moe takes them (csrc/kernels.h moe_glu): float32 biases of both
    projections (NULL: none) and the clamped SwiGLU's alpha and limit (alpha 0: plain)."""

    _fields_ = [("b13", _P), ("b2", _P), ("alpha", _F32), ("limit", _F32)]


_W_KINDS = {"int8": 1, "fp8": 2, "int4": 3, "mxfp4": 4}
# the paged cache's row formats (models/paged_cache.py) as csrc/kernels.h numbers them (KV_*)
_KV_KINDS = {torch.uint8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, INT4: 4}


def kv_kind(cache: torch.Tensor) -> int:
    """The cache's row format as the kernels number it (0: the model's dtype)."""
    return _KV_KINDS.get(cache.dtype, 0)


def wmat(w: torch.Tensor | QWeight | None) -> WMat:
    """The kernels' view of a packed weight (the tensors must outlive it); None: empty."""
    if w is None:
        return WMat()
    if isinstance(w, QWeight):
        colsum = None if w.colsum is None else w.colsum.data_ptr()
        zero = None if w.zero is None else w.zero.data_ptr()
        four_bit = w.fmt in quant.FOUR_BIT
        return WMat(
            w.data.data_ptr(),
            w.scale.data_ptr(),
            colsum,
            _kernel_group(w) if four_bit else w.group,
            _W_KINDS[w.fmt],
            zero,
            int(four_bit and not w.rotated),
            None if w.perm is None else w.perm.data_ptr(),
        )
    return WMat(w.data_ptr(), None, None, 0, 0)


class LayerSpec(ctypes.Structure):
    """One decoder layer for the fused decode step (csrc/layer.c, same field order):
    its sizes, options and the addresses of its packed weights, which must outlive it."""

    _fields_ = (
        [
            (n, _I64)
            for n in (
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "experts",
                "top_k",
                "moe_inter",
                "mlp_inter",
                "qk_norm",
                "norm_topk_prob",
                "kv_kind",
                "kv_row",
                "rotary_dim",
                "window",
                "groups",
                "topk_group",
                "sigmoid",
                "kv_lora_rank",
                "q_lora_rank",
                "nope_dim",
                "v_dim",
                "uk_stride",
                "uv_stride",
            )
        ]
        + [(n, _F32) for n in ("eps", "scale", "clip_qkv", "routed_scaling", "latent_eps")]
        + [
            (n, _P)
            for n in (
                "input_norm",
                "post_norm",
                "qkv_bias",
                "o_bias",
                "q_norm",
                "k_norm",
                "mlp_b13",
                "mlp_b2",
                "router_bias",
                "sinks",
                "router_f32",
                "correction_bias",
                "q_a_bias",
                "q_a_norm",
                "kv_a_bias",
                "kv_a_norm",
                "key_shift",
                "key_hinv",
            )
        ]
        + [
            (n, WMat)
            for n in (
                "wqkv",
                "wo",
                "router",
                "w13",
                "w2",
                "mlp_w13",
                "mlp_w2",
                "shared_gate",
                "wq_a",
                "wq_b",
                "wkv_a",
                "w_uk_t",
                "w_uv",
            )
        ]
        + [("glu", MoeGlu)]
    )


def _types(codes: str) -> list:
    """ctypes argument types from one letter each, in a prototype's order (csrc/kernels.h):
    p pointer, i int64_t, n int, f float, w const wmat *, s const LayerSpec *."""
    table = {
        "p": _P,
        "i": _I64,
        "n": _INT,
        "f": _F32,
        "w": ctypes.POINTER(WMat),
        "s": ctypes.POINTER(LayerSpec),
    }
    return [table[c] for c in codes.split()]


_SIGNATURES = {
    "ms_linear": "p i i i i w i i p p i i i n",
    "ms_moe": "p i i i w w i i p p i p p i p n",
    "ms_decode_attention": "p i i i i n p i i i p i i i i p i p i f p i p i n",
    "ms_prefill_attention": "p i i i i i n p i i p i i p i f p i p i n",
    "ms_rmsnorm": "p i p i p f p i i i n",
    "ms_rope_cache": "p i i i i i i p p p p p n p p i n",
    "ms_greedy": "p i i i p n",
    "ms_logprob_rows": "p i n i i p i p p p p n",
    "ms_logit_scores": "p i i i w i p p i p p p p i n",
    "ms_embed_int8": "p i p i p i i p n",
    "ms_set_amx": "p p",
    "ms_set_int8": "p p p p",
    "ms_set_int8_act_group": "i",
    "ms_set_int4": "p",
    "ms_set_attention_vnni": "p",
    "ms_set_batch_invariant": "i",
    "ms_decode_step": "s i p p i p p p p p p p i p i p f p p n",
}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, codes in _SIGNATURES.items():
        getattr(lib, name).argtypes = _types(codes)
    lib.ms_int8_path.restype = _INT
    for name in (
        "ms_rmsnorm",
        "ms_rope_cache",
        "ms_set_amx",
        "ms_set_int8",
        "ms_set_int8_act_group",
        "ms_set_int4",
        "ms_set_attention_vnni",
        "ms_set_batch_invariant",
    ):
        getattr(lib, name).restype = None
    return lib


def _simde_flags() -> list[str]:
    """Flags of the builds on SIMDe's portable intrinsics (tests only). -O2: at -O3 GCC takes
    95 s over attention.c's emulated AVX512-BF16 alone (19 s at -O2), and these builds check
    the code, not its speed."""
    import simde_py

    return ["-DMS_SIMDE", f"-I{simde_py.get_include()}", "-O2"]


@functools.cache
def load_build(isa: str, emulated: bool = False) -> ctypes.CDLL:
    """The kernel library for one instruction set (the caller checks the CPU runs it).
    `emulated` (tests only): the AVX-512 source compiled against SIMDe's portable intrinsics,
    so CPUs without AVX-512 can check its code. The avx512 build holds decode attention twice:
    its own, and ms_decode_attention_vnni with AVX512-VNNI (int4 KV rows on vpdpbusd), which
    enable() hands it where the CPU has VNNI."""
    flags = list(BUILDS[isa][0])
    name = f"kernels-{isa}"
    variants = []
    if isa == "avx512":
        again = ["-DMS_AVX512_VNNI", "-Dms_decode_attention=ms_decode_attention_vnni"]
        variants.append((_CSRC / "attention.c", again if emulated else [*again, "-mavx512vnni"]))
    if emulated and isa.startswith("avx512"):
        flags = [*BUILDS["avx2"][0], *(f for f in flags if f.startswith("-D")), *_simde_flags()]
        name += "-simde"
    sources = [_CSRC / f for f in KERNEL_SOURCES]
    return _bind(ctypes.CDLL(str(_build(sources, flags, name, variants))))


@functools.cache
def _amx_library(emulated: bool = False) -> ctypes.CDLL | None:
    """The AMX tile kernels, where the CPU reports AMX and Linux grants its register state.
    `emulated` (tests only): the same source on amx_emulation.h's plain-C tile instructions."""
    # amx_int4.c: int4.c's products on the int8 tiles, its float sums uncontracted as int4.c's
    sources, flags = [_CSRC / "amx.c", _CSRC / "amx_int4.c"], ["-ffp-contract=off"]
    if emulated:
        lib = ctypes.CDLL(str(_build(sources, [*flags, "-DMS_AMX_EMULATED"], "amx-emulated")))
    elif not _AMX_CPU <= cpu_flags():
        return None
    else:
        lib = ctypes.CDLL(str(_build(sources, [*flags, *_AMX_FLAGS], "amx")))
    lib.ms_amx_init.restype = _INT
    lib.ms_amx_int4_linear.argtypes = _types("p i p i i p p p i i n p i n")
    if not lib.ms_amx_init():
        log.info("AMX off: Linux refused the AMX register state (arch_prctl)")
        return None
    return lib


@functools.cache
def _vnni_library(isa: str, emulated: bool = False) -> ctypes.CDLL | None:
    """The VNNI int8 products for a build, where the CPU reports the extension. `emulated`
    (tests only): the build's source on SIMDe's intrinsics (AVX512-VNNI's for the AVX-512
    builds, AVX-VNNI's for AVX2's), which any CPU with AVX2 runs."""
    flags, cpu_flag = _VNNI[isa]
    base = BUILDS["avx512" if isa == "avx512bf16" else isa][0]
    name = f"vnni-{isa}"
    if emulated:
        wide = ["-DMS_AVX512"] if isa != "avx2" else []
        base = [*BUILDS["avx2"][0], *wide, *_simde_flags()]
        flags, name = [], f"vnni-{'avx512' if wide else 'avx2'}-simde"
    elif cpu_flag not in cpu_flags():
        return None
    return ctypes.CDLL(str(_build([_CSRC / "int8_vnni.c"], [*base, *flags], name)))


@functools.cache
def _int4_library(path: str) -> ctypes.CDLL:
    """csrc/int4.c built for one path ("vnni", "avxvnni", "avx2"; the caller checks the CPU
    runs it), its float sums in the reference's order (no contraction into FMAs).
    "avxvnni-emulated" (tests only): the AVX-VNNI source on SIMDe's vpdpbusd, which any CPU
    with AVX2 runs."""
    if path == "avxvnni-emulated":
        flags = [*BUILDS["avx2"][0], "-DMS_INT4_VNNI", *_simde_flags()]
    else:
        flags = list(_INT4[path][0])
    flags.append("-ffp-contract=off")
    lib = ctypes.CDLL(str(_build([_CSRC / "int4.c"], flags, f"int4-{path}")))
    lib.ms_int4_linear.argtypes = _types("p i p i i p p p i i n p i n")
    return lib


def _int4_path(isa: str, vnni: bool | None, emulated: bool) -> str | None:
    """The int4 path for a build, as int8's is chosen: VNNI where the CPU has it (AVX512-VNNI
    for the AVX-512 builds, AVX-VNNI for AVX2's) unless vnni=False, else vpmaddubsw on 8
    columns; None where no build succeeds. Emulated builds (tests) take the AVX-VNNI source
    on SIMDe."""
    choices = ["avx2"]
    if vnni is not False:
        choices.insert(0, "vnni" if isa.startswith("avx512") else "avxvnni")
    if emulated and vnni is not False:
        choices[0] = "avxvnni-emulated"
    for path in choices:
        if path in _INT4 and not _INT4[path][1] <= cpu_flags():
            continue
        try:
            _int4_library(path)
            return path
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("int4 kernel: build failed", path=path, error=str(exc))
    return None


# Set by enable(). ISA: the build in use ("avx512bf16", "avx512", "avx2") or None for ATen's
# kernels; AMX: the AVX-512 build hands products of many rows to AMX; INT8: what runs the
# integer products of int8 weights ("amx", "vnni", or the build's own vpmaddubsw: its ISA).
ISA: str | None = None
AMX = False
INT8: str | None = None
# INT4: what runs int4 weights' products (csrc/int4.c): "vnni", "avxvnni", "avx2"; "amx"
# ("amx-emulated" in tests; csrc/amx_int4.c, many rows, fewer on the int4.c path it was
# given); None: torch's
INT4: str | None = None
# ATTENTION_VNNI: the avx512 build's decode attention runs its copy built with AVX512-VNNI
# (int4 KV rows on vpdpbusd; the avx512bf16 and avx2 builds always take theirs)
ATTENTION_VNNI = False
_int4_linear = None  # the chosen path's linear layer (ms_int4_linear or ms_amx_int4_linear)
_lib: ctypes.CDLL | None = None
_selected = False  # enable() has run: engines keep what it chose (tests force paths this way)


def enable(
    isa: str | None = "auto",
    amx: bool | None = None,
    emulated: bool = False,
    vnni: bool | None = None,
) -> str | None:
    """Selects the kernels (engines on the CPU in bf16 call this once at start-up) and returns
    the instruction set in use, None for ATen's. isa: "auto" (the best this CPU runs) or one
    build to force (a fallback; asking for one the CPU cannot run raises RuntimeError rather
    than risk an illegal instruction); None turns them off. MOESERVE_BF16_KERNELS=0 turns the
    automatic choice off; a build asked for by name is still built, as amx=True/False
    overrides MOESERVE_AMX (amx: None follows it). vnni: False keeps int8 products off VNNI,
    and the avx512 build's decode attention (None: wherever the CPU has it).
    emulated (tests only): the AVX-512 build on SIMDe and AMX on amx_emulation.h, which any
    CPU with AVX2 runs."""
    global ISA, AMX, INT8, INT4, ATTENTION_VNNI, _lib, _selected, _int4_linear
    ISA, AMX, INT8, INT4, _lib, _selected, _int4_linear = None, False, None, None, None, True, None
    ATTENTION_VNNI = False
    if isa is None or (isa == "auto" and os.environ.get("MOESERVE_BF16_KERNELS", "1") == "0"):
        return None
    if isa == "auto":
        candidates = runnable_isas()
        if not candidates:
            log.info(
                "CPU kernels off: this CPU has neither AVX2 nor AVX-512; using ATen's",
                machine=platform.machine(),
            )
            return None
    elif isa not in runnable_isas() and not (emulated and "avx2" in runnable_isas()):
        raise RuntimeError(
            f"this CPU cannot run the {isa} kernels (its flags lack "
            f"{sorted(BUILDS[isa][1] - cpu_flags())})"
        )
    else:
        candidates = [isa]
    lib = None
    for (
        candidate
    ) in candidates:  # a compiler too old for one instruction set may still build the next
        try:
            lib, isa = load_build(candidate, emulated), candidate
            break
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("CPU kernels: build failed", isa=candidate, error=str(exc))
    if lib is None:
        log.warning("CPU kernels off: no build succeeded; using ATen's")
        return None
    want_amx = os.environ.get("MOESERVE_AMX", "1") != "0" if amx is None else amx
    amx_lib = vnni_lib = None
    if want_amx and (emulated or isa == "avx512") and isa != "avx512bf16":
        try:
            amx_lib = _amx_library(emulated)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("AMX off: build failed", error=str(exc))
    if vnni is not False:
        try:
            vnni_lib = _vnni_library(isa, emulated)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("VNNI off: build failed", error=str(exc))
    amx_int8 = amx_lib is not None and (emulated or "amx_int8" in cpu_flags())
    lib.ms_set_amx(
        ctypes.cast(amx_lib.ms_amx_block, _P) if amx_lib else None,
        ctypes.cast(amx_lib.ms_amx_new_call, _P) if amx_lib else None,
    )
    lib.ms_set_int8(
        ctypes.cast(vnni_lib.ms_int8_vnni_block, _P) if vnni_lib else None,
        ctypes.cast(amx_lib.ms_amx_int8_block, _P) if amx_int8 else None,
        ctypes.cast(vnni_lib.ms_int8_vnni_grouped, _P) if vnni_lib else None,
        ctypes.cast(amx_lib.ms_amx_int8_grouped, _P) if amx_int8 else None,
    )
    lib.ms_set_int8_act_group(quant.INT8_ACT_GROUP)
    # the avx512 build's decode attention with VNNI where the CPU has it (vnni=False: not)
    ATTENTION_VNNI = (
        isa == "avx512" and vnni is not False and (emulated or "avx512_vnni" in cpu_flags())
    )
    lib.ms_set_attention_vnni(
        ctypes.cast(lib.ms_decode_attention_vnni, _P) if ATTENTION_VNNI else None
    )
    ISA, AMX, _lib = isa, amx_lib is not None, lib
    INT8 = {2: "amx", 1: "vnni", 0: isa}[lib.ms_int8_path()]
    INT4 = _int4_path(isa, vnni, emulated)
    int4_lib = _int4_library(INT4) if INT4 else None
    int4_wblock, _int4_linear = (
        (int4_lib.ms_int4_wblock, int4_lib.ms_int4_linear) if INT4 else (None, None)
    )
    if INT4 and amx_int8:  # many rows on the int8 tiles, fewer on the path chosen above
        amx_lib.ms_amx_int4_fallback(ctypes.cast(int4_wblock, _P), ctypes.cast(_int4_linear, _P))
        int4_wblock, _int4_linear = amx_lib.ms_amx_int4_wblock, amx_lib.ms_amx_int4_linear
        INT4 = "amx-emulated" if emulated else "amx"
    lib.ms_set_int4(ctypes.cast(int4_wblock, _P) if INT4 else None)
    return ISA


# rows up to which a product rounds each row as it would alone (speculative verification)
INVARIANT_ROWS = 16


def batch_invariant(on: bool) -> None:
    """Decode-sized products (up to INVARIANT_ROWS rows) round each row as alone, in any batch:
    an engine that speculates turns it on, so the k + 1 rows it verifies give its plain decode
    steps' bits. It costs batched decode the shared register tiles (and AMX below 17 rows), so
    it is off otherwise. Process-wide, on the library enable() chose."""
    if _lib is not None:
        _lib.ms_set_batch_invariant(INVARIANT_ROWS if on else 0)


def int8_act_group(group: int) -> None:
    """Inputs per activation scale of int8 weights' products, 32 or 0 (one scale a row), for
    the torch reference (quant.INT8_ACT_GROUP) and the kernels alike, process-wide
    (MOESERVE_INT8_ACT_GROUP sets it at start-up)."""
    if group not in (0, 32):
        raise ValueError(f"int8 activation groups are 32 inputs or 0 (one a row), not {group}")
    quant.INT8_ACT_GROUP = group
    if _lib is not None:
        _lib.ms_set_int8_act_group(group)


def enable_once() -> str | None:
    """The kernels chosen by the first enable() of the process (auto if none ran yet)."""
    return ISA if _selected else enable()


def paths() -> dict[str, str]:
    """What each layer kind runs on, for the start-up log line (SPEC section 12)."""
    if ISA is None:
        return {
            "linear": "aten",
            "moe_token": "aten",
            "moe_batch": "aten",
            "decode_attention": "aten",
            "int8": "aten",
            "int4": "aten",
        }
    tiles = "amx" if AMX else ISA
    return {
        "linear": ISA,
        "moe_token": ISA,
        "moe_batch": tiles,
        "decode_attention": f"{ISA}+vnni" if ATTENTION_VNNI else ISA,
        "int8": INT8,
        "int4": INT4 or "aten",
    }


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels take this activation: enabled, bf16, on the CPU."""
    return ISA is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _threads() -> int:
    return torch.get_num_threads()


def _check(status: int, what: str) -> None:
    if status == -1:
        raise MemoryError(f"{what}: the kernel could not allocate its scratch memory")
    if status:
        raise ValueError(f"{what}: invalid input (status {status})")


# ---- packed weights --------------------------------------------------------------------


def _pack(w: torch.Tensor, run: int) -> torch.Tensor:
    """[..., N, K] -> [..., ceil(K/run), N, run]: blocks of 16 output columns, each a run of
    64-byte rows holding the 16 columns' `run` consecutive inputs; the last N % 16 columns a
    narrower block; K zero-padded to a multiple of `run`. In huge pages (huge_pages.py: every
    decode step streams the weights) where it fills one."""
    *lead, n, k = w.shape
    kp = -(-k // run) * run
    w = F.pad(w.reshape(-1, n, k), (0, kp - k))
    m, full = w.shape[0], n // 16 * 16
    blocks = w[:, :full].reshape(m, n // 16, 16, kp // run, run).permute(0, 1, 3, 2, 4)
    tail = w[:, full:].reshape(m, n - full, kp // run, run).permute(0, 2, 1, 3)
    flat = torch.cat((blocks.reshape(m, -1), tail.reshape(m, -1)), dim=1)
    return huge_pages.copy_of(flat.reshape(*lead, kp // run, n, run))


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] row-major -> [..., ceil(K/2), N, 2] bf16 in the kernels' layout
    (csrc/kernels.h): input pairs (2k, 2k+1), the pair vdpbf16ps and AMX's bf16 tiles read."""
    return _pack(w.to(torch.bfloat16), 2)


def pack_qweight(w: QWeight) -> QWeight:
    """A row-major 8-bit weight -> the kernels' layout: input quads [..., ceil(K/4), N, 4]
    (the quad vpdpbusd and AMX's int8 tiles read), with int8's column sums (VNNI multiplies
    unsigned activations and takes them off), zero-padded to whole 16-column blocks [...,
    ceil(N/16) * 16]."""
    if w.packed:
        return w
    if w.fmt in quant.FOUR_BIT:
        return _pack_int4(w)
    colsum = None
    if w.fmt == "int8":
        n = w.data.shape[-2]
        sums = w.data.sum(dim=-1, dtype=torch.int32)
        colsum = F.pad(sums, (0, -(-n // 16) * 16 - n))
    if w.fmt == "fp8" and float(w.scale.max()) >= 2.0**7:
        # the kernels fold fp8's exponent rebias (2^120) into the scale: keep it finite
        raise ValueError(f"fp8 weight scales must be below 128 (largest {float(w.scale.max())})")
    data = _pack(w.data.view(torch.uint8), 4)
    colsum = None if colsum is None else huge_pages.copy_of(colsum)
    return QWeight(w.fmt, data, huge_pages.copy_of(w.scale), w.group, w.in_features, colsum)


# mxfp4's doubled values (+ 12) -> their e2m1 codes (0 for both zeros)
_E2M1_CODES = torch.zeros(25, dtype=torch.uint8)
for _code, _value in reversed(list(enumerate(quant.E2M1_DOUBLED))):
    _E2M1_CODES[_value + 12] = _code


def _pack_int4(w: QWeight) -> QWeight:
    """A row-major 4-bit weight -> csrc/int4.c's layout [..., Kp/8, N, 4] bytes (Kp: K rounded
    up to 8): int4 values as their levels v + 8 (the zero points kept beside), mxfp4's as their
    e2m1 codes; byte j of a column's quad in octet o holds input 8o + j low and 8o + 4 + j
    high, so a mask and a shift give two quads of the int8 layout."""
    if w.group % 8 and w.group < w.in_features:
        raise ValueError(f"int4 groups must be a multiple of 8 inputs (got {w.group})")
    k = w.data.shape[-1]
    kp = -(-k // 8) * 8
    if w.fmt == "mxfp4":
        u = _E2M1_CODES[w.data.long() + 12]
    else:
        u = (w.data.to(torch.int16) + 8).to(torch.uint8)
    u = F.pad(u, (0, kp - k))  # padding: activations there are 0
    octets = u.unflatten(-1, (kp // 8, 2, 4))
    nibbles = (octets[..., 0, :] | (octets[..., 1, :] << 4)).flatten(-2)  # [..., N, Kp/2]
    data = _pack(nibbles, 4)
    zero = None if w.zero is None else huge_pages.copy_of(w.zero)
    perm = None if w.perm is None else w.perm.to(torch.int32).contiguous()
    return QWeight(
        w.fmt,
        data,
        huge_pages.copy_of(w.scale),
        w.group,
        w.in_features,
        rotated=w.rotated,
        zero=zero,
        perm=perm,
    )


def _kernel_group(w: QWeight) -> int:
    """The group a 4-bit weight's kernels read: its own, or the padded row where one group
    spans all the inputs (per channel, K not a multiple of 8)."""
    return -(-w.in_features // 8) * 8 if w.group >= w.in_features else w.group


def unpack_weight(p: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_weight, for tests and checks: [..., Kp/2, N, 2] -> [..., N, k]."""
    *lead, half, n, _ = p.shape
    kp = 2 * half
    flat = p.reshape(-1, n * kp)
    m, full = flat.shape[0], n // 16 * 16
    blocks = (
        flat[:, : full * kp]
        .reshape(m, n // 16, half, 16, 2)
        .permute(0, 1, 3, 2, 4)
        .reshape(m, full, kp)
    )
    tail = (
        flat[:, full * kp :]
        .reshape(m, half, n - full, 2)
        .permute(0, 2, 1, 3)
        .reshape(m, n - full, kp)
    )
    return torch.cat((blocks, tail), dim=1)[..., :k].reshape(*lead, n, k)


def is_packed(w: torch.Tensor | QWeight, matrix_dims: int = 2) -> bool:
    """A weight of a `matrix_dims`-dimensional matrix (2: a linear layer's, 3: stacked
    experts') is packed when it has one dimension more (8-bit: when laid out in quads)."""
    if isinstance(w, QWeight):
        return w.packed
    return w.dim() == matrix_dims + 1


def _in_features(w: torch.Tensor | QWeight) -> int:
    """The padded input width of a packed weight."""
    if isinstance(w, QWeight):
        return (8 if w.fmt in quant.FOUR_BIT else 4) * w.data.shape[-3]
    return 2 * w.shape[-3]


# ---- the kernels ----------------------------------------------------------------------------


def linear(
    x: torch.Tensor, weight: torch.Tensor | QWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] bf16 @ packed weight [K/2, N, 2] or packed 8-bit QWeight (+ bias [N]) ->
    [..., N] bf16."""
    k = x.shape[-1]
    n = weight.scale.shape[-1] if isinstance(weight, QWeight) else weight.shape[-2]
    if isinstance(weight, QWeight) and weight.fmt in quant.FOUR_BIT:
        if INT4 is None:  # (the main library's int4 products are int4.c's)
            raise ValueError("linear: no int4 kernel on this CPU (enable() chose none)")
        if k % 8:  # ms_linear's 4-bit products read whole octets
            return _linear_int4(x, weight, bias)
    if not 0 <= _in_features(weight) - k <= 3:
        raise ValueError(f"linear: x has {k} features, the packed weight {_in_features(weight)}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = x.new_empty(*x.shape[:-1], n)
    w = wmat(weight)
    _check(
        _lib.ms_linear(
            rows.data_ptr(),
            0,
            rows.stride(0),
            rows.shape[0],
            k,
            ctypes.byref(w),
            0,
            n,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            0,
            n,
            1,
            _threads(),
        ),
        "linear",
    )
    return y


def _linear_int4(x: torch.Tensor, weight: QWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times a packed 4-bit weight (+ bias) on csrc/int4.c's own linear (W4A8), for
    the weights ms_linear does not take (K not a multiple of 8): activations
    quantized in torch, the bias added and rounded as the torch reference does, so the result
    is its float for float (as ms_linear's is)."""
    y = int4_products(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def int4_products(rows: torch.Tensor, weight: QWeight) -> torch.Tensor:
    """rows [M, K] times a packed int4 / mxfp4 weight -> [M, N] float32, on the path enable()
    chose (INT4). The activations are quantized by the torch reference's own function
    (quant.quantize_activations: rotated where the weight is, int8 per row)."""
    k, n = rows.shape[-1], weight.out_features
    kp = _in_features(weight)
    if k != weight.in_features or INT4 is None:
        raise ValueError(
            f"linear: x has {k} features, the int4 weight {weight.in_features}"
            if INT4 is not None
            else "linear: no int4 kernel on this CPU (enable() chose none)"
        )
    q, sx = quant.quantize_activations(rows, weight)
    q = F.pad(q, (0, kp - k)).contiguous()
    y = torch.empty(q.shape[0], n, dtype=torch.float32)
    _check(
        _int4_linear(
            q.data_ptr(),
            kp,
            sx.contiguous().data_ptr(),
            q.shape[0],
            kp,
            weight.data.data_ptr(),
            weight.scale.data_ptr(),
            None if weight.zero is None else weight.zero.data_ptr(),
            _kernel_group(weight),
            n,
            int(weight.fmt == "mxfp4"),
            y.data_ptr(),
            n,
            _threads(),
        ),
        "linear (int4)",
    )
    return y


def linear_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head products: x [B, H, K] (any row strides, unit last stride) and packed weights
    [H, K/2, N, 2] -> [B, H, N], out[:, h] = x[:, h] @ W_h^T (MLA's absorbed projections)."""
    b, h, k = x.shape
    n = weight.shape[-2]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = x.new_empty(b, h, n)
    w_stride = weight[0].numel()
    w = wmat(weight)
    _check(
        _lib.ms_linear(
            x.data_ptr(),
            x.stride(1),
            x.stride(0),
            b,
            k,
            ctypes.byref(w),
            w_stride,
            n,
            None,
            y.data_ptr(),
            n,
            h * n,
            h,
            _threads(),
        ),
        "linear_heads",
    )
    return y


def moe(
    x: torch.Tensor,
    w13: torch.Tensor | QWeight,
    w2: torch.Tensor | QWeight,
    ids: torch.Tensor,
    weights: torch.Tensor,
    glu: MoeGlu | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts of tokens x [T, D] in one call: packed w13 [E, D/2, 2I, 2] (gate
    columns then up), w2 [E, I/2, D, 2] (or packed 8-bit QWeights of the same matrices),
    expert ids and router weights [T, A] -> the MoE output [T, D] bf16 and the tokens per
    expert [E]. `glu`: gpt-oss's biases and clamped SwiGLU (its tensors outlive the call)."""
    t, d = x.shape
    if isinstance(w13, QWeight) and w13.fmt in quant.FOUR_BIT and not int4_moe_fits(w13, d):
        raise ValueError("moe: 4-bit experts need the int4 kernel and D and I % 8 == 0")
    if isinstance(w2, QWeight) and w2.perm is not None:  # ms_moe gathers the tokens only
        raise ValueError("moe: an act-order w2 is folded into w13 first (act_order.py)")
    if isinstance(w13, QWeight):
        e, i = w13.scale.shape[0], w13.scale.shape[-1] // 2
    else:
        e, i = w13.shape[0], w13.shape[-2] // 2
    m13, m2 = wmat(w13), wmat(w2)
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = x.new_empty(t, d)
    counts = torch.empty(e, dtype=torch.int64)
    _check(
        _lib.ms_moe(
            x.data_ptr(),
            x.stride(0),
            t,
            d,
            ctypes.byref(m13),
            ctypes.byref(m2),
            e,
            i,
            ids.data_ptr(),
            weights.data_ptr(),
            ids.shape[1],
            None if glu is None else ctypes.byref(glu),
            out.data_ptr(),
            d,
            counts.data_ptr(),
            _threads(),
        ),
        "moe",
    )
    return out, counts


def int4_moe_fits(w13: QWeight, d: int) -> bool:
    """Whether the MoE kernel takes these 4-bit experts (int4, rotated or not, or mxfp4): an
    int4 path chosen (INT4), and D and I multiples of 8 (its int8 rows are padded to 4 inputs,
    the 4-bit octets read 8)."""
    i = w13.scale.shape[-1] // 2
    return INT4 is not None and d % 8 == 0 and i % 8 == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    v_dim: int | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Single-token queries q [B, H, dk] (unit last stride, rows at any stride) over their
    paged contexts: caches [S, G, row] in any of the KV formats (models/paged_cache.py; MLA: one latent
    cache passed as both, `v_dim` its value width), block_tables [B, W] int32, context_lens
    [B] int32 -> [B, H, dv] bf16. `sinks` [H] float32: gpt-oss's per-head sink logits;
    `window` > 0: only each context's last `window` positions are attended."""
    b, h, dk = q.shape
    g = k_cache.shape[1]
    dv = v_dim or kv_width(v_cache)
    if not reads_alone(dv, dk, k_cache.dtype):
        # the kernel rotates q by dk's blocks, the outputs back by dv's (int4: reads dv's groups)
        raise ValueError(
            f"quantized cache rows of {dk} values rotate (or group) in blocks that {dv} values "
            "do not start"
        )
    if q.stride(-1) != 1 or q.stride(1) != dk:
        q = q.contiguous()
    out = q.new_empty(b, h, dv)
    _check(
        _lib.ms_decode_attention(
            q.data_ptr(),
            q.stride(0),
            b,
            h,
            g,
            kv_kind(k_cache),
            k_cache.data_ptr(),
            k_cache.stride(0),
            k_cache.stride(1),
            dk,
            v_cache.data_ptr(),
            v_cache.stride(0),
            v_cache.stride(1),
            dv,
            dk if v_cache is k_cache else dv,
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            block_size,
            scale,
            None if sinks is None else sinks.data_ptr(),
            window,
            out.data_ptr(),
            h * dv,
            _threads(),
        ),
        "decode_attention",
    )
    return out


def prefill_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ms_prefill_attention takes a chunk's queries q [C, H, d] over this cache: the
    AVX512-BF16 build (vdpbf16ps), bf16 queries, a bf16 or quantized cache of rows of d
    values, d a multiple of 32 up to 256, at most 96 query heads a kv head. Elsewhere ATen's
    flash kernel runs (models/attention_parts.py)."""
    h, d = q.shape[1], q.shape[2]
    g = k_cache.shape[1]
    return (
        ISA == "avx512bf16"
        and q.dtype == torch.bfloat16
        and (k_cache.dtype == torch.bfloat16 or kv_kind(k_cache) != 0)
        and d % 32 == 0
        and d <= 256
        and h % g == 0
        and h // g <= 96
        and kv_width(k_cache) == d
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_len: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """A prompt chunk's queries q [C, H, d] (positions context_len .. context_len + C - 1,
    their keys and values already in the caches) attending causally to their sequence's
    context, read in place from the caches [S, G, row] (bf16, or a quantized format read
    back as models/paged_cache.py's dequantize reads it) by `slots` [context_len + C] (each
    position's slot) -> [C, H, d] bf16 (prefill_attention_fits says where it runs).
    `sinks` [H] float32: gpt-oss's per-head sink logits; `window` > 0: each query sees its
    last `window` positions."""
    c, h, d = q.shape
    if q.stride(-1) != 1 or q.stride(1) != d:
        q = q.contiguous()
    slots = slots.to(torch.int64).contiguous()
    out = q.new_empty(c, h, d)
    _check(
        _lib.ms_prefill_attention(
            q.data_ptr(),
            q.stride(0),
            c,
            h,
            k_cache.shape[1],
            d,
            kv_kind(k_cache),
            k_cache.data_ptr(),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.data_ptr(),
            v_cache.stride(0),
            v_cache.stride(1),
            slots.data_ptr(),
            context_len,
            scale,
            None if sinks is None else sinks.data_ptr(),
            window,
            out.data_ptr(),
            h * d,
            _threads(),
        ),
        "prefill_attention",
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim, rounded as the reference rounds; with
    `residual`, residual += x first (in place) and the sum is normalised."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty(x.shape)
    res = None if residual is None else residual.view(-1, d)
    _lib.ms_rmsnorm(
        rows.data_ptr(),
        rows.stride(0),
        None if res is None else res.data_ptr(),
        0 if res is None else res.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        d,
        rows.shape[0],
        d,
        _threads(),
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    slots: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_shift: torch.Tensor | None = None,
    key_hinv: torch.Tensor | None = None,
) -> None:
    """qkv [T, H + 2G, d] (contiguous): rotates the query and key heads in place (cos/sin
    [T, rd] bf16, contiguous: the first rd <= d dims of each head rotate, the rest pass, as
    in partial rotary), takes key_shift [G, d] float32 off the rotated keys (in place too)
    and writes the keys and values to the cache rows `slots` [T] int64, in the caches' format
    (8-bit formats quantized as they are written; int4 keys rounded through key_hinv
    [G, d, d] float32 where given: paged_cache.quantize_int4's weights). Both from
    executor/key_calibration.py."""
    t, _, d = qkv.shape
    rd = cos.shape[-1]
    if rd > d or rd % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope tables of width {rd} for heads of {d}: even, <= d, contiguous")
    for table, shape, name in (
        (key_shift, (num_kv_heads, d), "a key shift"),
        (key_hinv, (num_kv_heads, d, d), "a key rounding"),
    ):
        if table is not None and (
            table.shape != shape or table.dtype != torch.float32 or not table.is_contiguous()
        ):
            dims = ", ".join(map(str, shape))
            raise ValueError(f"{name} is [{dims}] float32, contiguous")
    _lib.ms_rope_cache(
        qkv.data_ptr(),
        qkv.stride(0),
        t,
        num_heads,
        num_kv_heads,
        d,
        rd,
        cos.data_ptr(),
        sin.data_ptr(),
        None if key_shift is None else key_shift.data_ptr(),
        None if key_hinv is None else key_hinv.data_ptr(),
        None if slots is None else slots.data_ptr(),
        kv_kind(k_cache),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[-1],
        _threads(),
    )


def greedy(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum of logits [rows, vocab] (bf16), as
    logits.max(dim=-1).indices: a vector pass in C where torch's bf16 max() is scalar
    (3.5 ms over [32, 32000], longer than some decode steps)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _lib.ms_greedy(
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[0],
        logits.shape[1],
        out.data_ptr(),
        _threads(),
    )
    return out.tolist()


def _scores(rows: int, k: int):
    """The outputs of the scoring kernels: each row's target logprob and rank, top-k ids and
    logprobs."""
    return (
        torch.empty(rows, dtype=torch.float32),
        torch.empty(rows, dtype=torch.int64),
        torch.empty(rows, k, dtype=torch.int64),
        torch.empty(rows, k, dtype=torch.float32),
    )


def logprob_rows(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt scoring of logits [rows, vocab] (bf16 or float32): each row's log-softmax at
    targets[row] (int64), its rank (1 + the logits above it) and the top k (ids, logprobs;
    ties: the lower id first), in two vector passes a row, with no float32 copy of the logits."""
    if logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"logprob_rows: logits of {logits.dtype}, not bf16 or float32")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.to(torch.int64).contiguous()
    out = _scores(logits.shape[0], k)
    _check(
        _lib.ms_logprob_rows(
            logits.data_ptr(),
            logits.stride(0),
            int(logits.dtype == torch.float32),
            logits.shape[0],
            logits.shape[1],
            targets.data_ptr(),
            k,
            *(t.data_ptr() for t in out),
            _threads(),
        ),
        "logprob_rows (a target outside the vocabulary, or k larger than it)",
    )
    return out


def logit_scores(
    x: torch.Tensor,
    weight: torch.Tensor | QWeight,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    k: int,
    tile_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprob_rows of the logits x [rows, K] (bf16) @ packed weight^T (+ bias), the lm_head's
    own bf16 logits, computed and scored a tile of rows at a time in C (tile_rows; 0: as many
    as 32M logits hold, in the kernels' scratch): no [rows, vocab] tensor is made (int4
    weights, which ms_linear may not take, go through linear())."""
    if isinstance(weight, QWeight) and weight.fmt == "int4":
        return logprob_rows(linear(x, weight, bias), targets, k)
    k_in = x.shape[-1]
    n = weight.scale.shape[-1] if isinstance(weight, QWeight) else weight.shape[-2]
    if not 0 <= _in_features(weight) - k_in <= 3:
        raise ValueError(f"logit_scores: x has {k_in} features, the weight {_in_features(weight)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    targets = targets.to(torch.int64).contiguous()
    out = _scores(x.shape[0], k)
    w = wmat(weight)
    _check(
        _lib.ms_logit_scores(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            k_in,
            ctypes.byref(w),
            n,
            None if bias is None else bias.data_ptr(),
            targets.data_ptr(),
            k,
            *(t.data_ptr() for t in out),
            tile_rows,
            _threads(),
        ),
        "logit_scores (a target outside the vocabulary, or k larger than it)",
    )
    return out


def embed_int8(table: QWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows of an int8 embedding table (quant.quantize_int8: rotated, a scale per row) for
    ids [...] -> [..., D] bf16, dequantized and rotated back in C (hadamard_rotate, the
    floats of hadamard.rotate): a decode step's 32 rows in ~10 us, where torch's products
    take 0.3 ms."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    data, scale = table.data, table.scale
    vocab, d = data.shape
    out = torch.empty(flat.shape[0], d, dtype=torch.bfloat16)
    status = _lib.ms_embed_int8(
        data.data_ptr(),
        data.stride(0),
        scale.data_ptr(),
        vocab,
        flat.data_ptr(),
        flat.shape[0],
        d,
        out.data_ptr(),
        _threads(),
    )
    if status == -2:  # as torch's lookup fails on an id outside the table
        raise IndexError(f"embedding: a token id outside [0, {vocab})")
    _check(status, "embed_int8")
    return out.view(*ids.shape, d)


class DecodeStep:
    """A whole decode step of a model whose every layer the fused kernel covers (csrc/layer.c):
    the layer specs, the embedding and final-norm weights and the float32 rope tables, held
    here with the addresses the kernel reads (the tensors must outlive it). embed None: the
    caller looks the rows up (an int8 table) and decode_step gets them in place of ids."""

    def __init__(
        self,
        specs: list[LayerSpec],
        embed: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        final_norm: torch.Tensor,
        eps: float,
    ) -> None:
        self.layers = (LayerSpec * len(specs))(*specs)
        self.tensors = (embed, cos, sin, final_norm)
        self.embeds = embed is not None
        self.eps = eps
        self.hidden = specs[0].hidden
        self.moe_layers, self.experts = (
            sum(1 for s in specs if s.experts),
            max(s.experts for s in specs),
        )
        self._caches: tuple[list, ctypes.Array, ctypes.Array] | None = None

    def cache_addresses(self, kv_caches: list) -> tuple[ctypes.Array, ctypes.Array]:
        """The caches' addresses; the layers learn their row format from them."""
        if self._caches is None or self._caches[0] is not kv_caches:
            # a layer's (key, value) caches, or MLA's one latent cache as both
            keys = (_P * len(kv_caches))(*[c[0].data_ptr() for c in kv_caches])
            values = (_P * len(kv_caches))(*[c[-1].data_ptr() for c in kv_caches])
            for spec, c in zip(self.layers, kv_caches):
                spec.kv_kind, spec.kv_row = kv_kind(c[0]), c[0].shape[-1]
            self._caches = (kv_caches, keys, values)
        return self._caches[1], self._caches[2]


def decode_step(
    step: DecodeStep,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_caches: list,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a decode step of T single-token rows, and the final norm -> hidden
    [T, D] and the tokens per expert [MoE layers, E]. input_ids: token ids [T], or their
    embedded rows [T, D] where the step has no embedding table (DecodeStep)."""
    t = input_ids.shape[0]
    embed, cos, sin, final_norm = step.tensors
    keys, values = step.cache_addresses(kv_caches)
    # without a table the kernel reads its input rows from `hidden` (it writes it last)
    hidden = final_norm.new_empty(t, step.hidden) if embed is not None else input_ids.clone()
    counts = torch.empty(step.moe_layers, step.experts, dtype=torch.int64)
    _check(
        _lib.ms_decode_step(
            step.layers,
            len(step.layers),
            None if embed is None else embed.data_ptr(),
            None if embed is None else input_ids.data_ptr(),
            t,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            keys,
            values,
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            block_size,
            final_norm.data_ptr(),
            step.eps,
            hidden.data_ptr(),
            counts.data_ptr(),
            _threads(),
        ),
        "decode_step",
    )
    return hidden, counts
