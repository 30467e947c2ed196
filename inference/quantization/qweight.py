"""8-bit and 4-bit weights: int8 (W8A8), int4 (W4A8) and fp8 e4m3.

- int8: weights and activations both rotated along the inputs (hadamard.rotate, an
  orthogonal map: (x R)(W R)^T = x W^T), as QuaRot does (arXiv 2404.00456). Weights get
  symmetric per-output-channel scales at load from a bf16/float32 checkpoint; activations
  are quantized per token at run time (amax / 127, one scale a row); each row's exact
  int32 sum over all inputs times the row's scale, then the channel's. Unrotated, a few
  outlier channels set each token's scale: SmolLM2 lost ~4% of perplexity with per-token
  scales (a torch simulation); rotated, per-token scales lose +0.29% (bench/NOTES.md).
  MOESERVE_INT8_ACT_GROUP=32: a scale per 32 inputs of a token instead, as llama.cpp's
  Q8_0 blocks; each group's exact integer sums times its scale, added group by group in
  float32 (fused multiply-adds in the kernels), then times the channel's scale. On SmolLM2
  it halves the perplexity change (+0.17% against +0.28%) but keeps to the bf16 model's
  greedy continuations no longer (21.1 against 23.1 of 48 tokens over 64 passages;
  bench/NOTES.md), so it is not the default.
- fp8 (e4m3): FP8 checkpoints as published (128x128 block scales `weight_scale_inv`, as
  DeepSeek-V3 and the Qwen3 FP8 releases ship them; per-tensor or per-channel `weight_scale`,
  as compressed-tensors writes them), or a bf16 checkpoint quantized per channel at load. On
  the CPU they run weight-only (each weight widened and scaled in the kernel); on CUDA through
  torch._scaled_mm with per-token fp8 activations (unmeasured: no GPU run has proven it yet).

- int4 (W4A8, as llama.cpp's Q4_0 x Q8_0 and SGLang's int4 x int8 kernel run it): the same
  rotated rows as int8 in 4 bits, a float32 scale per output channel and group of 128
  inputs. Q4_0's symmetric levels: the group's value of largest magnitude m sets the scale
  m / -8, so it lands on -8 exactly and the others round into [-8, 7], all 16 levels used
  ([-7, 7] would waste one: a 7% coarser step). Activations are int8 per token as int8's;
  each group's exact integer sum times its scale, summed over the groups in order in
  float32, then times the token's scale: the float order the kernel (csrc/int4.c)
  reproduces. `rotated=False` (quantize_int4) keeps the weights unrotated, to measure what
  the rotation buys (bench/quant_bench.py).
  Published 4-bit checkpoints (GPTQ, AWQ, compressed-tensors) come in through
  int4_from_levels: levels in [0, 15], w = (level - zero) * scale, with integer zero points
  per (column, group) where the format is asymmetric (`zero`; None: 8, symmetric), groups of
  32, 64, 128 inputs or one per channel; the same layout and kernels.
- mxfp4 (gpt-oss's experts, OCP MX): e2m1 values in blocks of 32 inputs, each block an e8m0
  exponent e (value * 2^(e - 127)). Held as int8 doubled values 2 * e2m1 (in {0, 1, 2, 3,
  4, 6, 8, 12} and their negatives: integers, so the W4A8 products stay exact integer sums)
  and a float32 scale 2^(e - 128) per column and block; mxfp4_from_blocks takes the
  published tensors. Packed, the nibbles are the e2m1 codes, which the kernels turn into
  the doubled values by a register lookup.

A QWeight keeps the 8-bit values (int8: of the rotated rows) and their scales in one of two
layouts: row-major [..., N, K] (the torch path: CUDA, float32 engines, CPUs without our
kernels) or packed for the CPU kernels (cpu_kernels.pack_qweight). Scales are float32 [...,
G, N]: one per group of `group` inputs (all K for per-channel scales) and output column.

This module is the torch reference of the arithmetic the kernels do (same rounding rules),
so the two paths can be held equal in tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.quantization.hadamard import rotate, rotate_by_products

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128  # the block scales' size, rows and inputs alike, as the checkpoints ship them


FOUR_BIT = ("int4", "mxfp4")  # the formats of the packed 4-bit layout (csrc/int4.c)


def _int8_act_group() -> int:
    value = os.environ.get("MOESERVE_INT8_ACT_GROUP", "0")
    if value not in ("0", "32"):
        raise ValueError(
            f"MOESERVE_INT8_ACT_GROUP must be 32 (a scale per 32 inputs) or 0 (one a token), "
            f"not {value!r}"
        )
    return int(value)


# inputs per activation scale of int8 weights' products (0: one scale a row); the kernels
# take it from here at cpu_kernels.enable (cpu_kernels.int8_act_group changes both)
INT8_ACT_GROUP = _int8_act_group()


@dataclass(eq=False)
class QWeight:
    fmt: str  # "int8" | "int4" | "mxfp4" | "fp8"
    # int8 / float8_e4m3fn [..., N, K] (int4: int8 values level - 8 in [-8, 7]; mxfp4: int8
    # doubled e2m1 values 2v in [-12, 12]), or packed uint8 [..., Kq/4, N, 4] (int4, mxfp4:
    # [..., Kp/8, N, 4], two nibbles a byte, cpu.pack_qweight)
    data: torch.Tensor
    scale: torch.Tensor  # float32 [..., G, N]
    group: int  # inputs per scale group
    in_features: int
    colsum: torch.Tensor | None = None  # int32 [..., N16], each column's sum (packed int8 only)
    rotated: bool = True  # int8 / int4: values of the rotated rows (hadamard.rotate)
    # int4 only: int8 [..., G, N] zero points in the level domain, w = (level - zero) *
    # scale = (data + 8 - zero) * scale; None: symmetric (every zero 8)
    zero: torch.Tensor | None = None
    # int4 only, act-order (GPTQ desc_act): int32 [..., K], column j of the weight is input
    # perm[j] (each group's inputs contiguous); activations are gathered so before their
    # products (y = W x = W[:, perm] x[perm]). None: the inputs in order
    perm: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.data.dim() == self.scale.dim() + 1

    @property
    def out_features(self) -> int:
        return self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.data, self.scale, self.colsum, self.zero, self.perm)
            if t is not None
        )

    def __getitem__(self, index: int) -> QWeight:
        """One matrix of a stack (an expert of [E, N, K])."""
        colsum = None if self.colsum is None else self.colsum[index]
        zero = None if self.zero is None else self.zero[index]
        perm = None if self.perm is None else self.perm[index]
        return QWeight(
            self.fmt,
            self.data[index],
            self.scale[index],
            self.group,
            self.in_features,
            colsum,
            self.rotated,
            zero,
            perm,
        )

    @property
    def rotates(self) -> bool:
        """Whether activations are rotated before the integer products (weights were)."""
        return self.fmt in ("int8", "int4", "mxfp4") and self.rotated

    def integers(self) -> torch.Tensor:
        """The integer weights [..., N, K] the W4A8 products sum exactly, each times its
        group's scale (int4: level - zero; mxfp4: 2 * e2m1), as int32; row-major only; in the
        order of `perm` where there is one (the gathered activations')."""
        if self.packed or self.fmt not in FOUR_BIT:
            raise ValueError("integers() reads a row-major int4 or mxfp4 weight")
        w = self.data.to(torch.int32)
        if self.zero is not None:
            shift = self.zero.to(torch.int32) - 8  # zero 8 (symmetric) leaves data as it is
            w = w - per_input(shift, self.group, self.in_features)
        return w

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weights [..., N, K] (row-major layout only; int8/int4 rotated back)."""
        if self.packed:
            raise ValueError("dequantize() reads the row-major layout, not a packed weight")
        scale = per_input(self.scale, self.group, self.in_features)
        values = self.integers() if self.fmt in FOUR_BIT else self.data
        w = values.float() * scale
        if self.perm is not None:  # back to the inputs' own order
            w = torch.empty_like(w).scatter_(
                -1, self.perm.long().unsqueeze(-2).expand_as(w).contiguous(), w
            )
        return (rotate_by_products(w) if self.rotates else w).to(dtype)


def per_input(grouped: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[..., G, N] values per (group, column) -> [..., N, k], each input's group's value."""
    return grouped.transpose(-1, -2).repeat_interleave(group, dim=-1)[..., :k]


# ---- quantizing ---------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: q = rne(x * 127 / amax) in [-127, 127] and the scales amax /
    127 (0 for an all-zero row), in float32 as the kernels do -> q [..., K], scales [...]."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # a true division (torch turns `127.0 / amax` into 127 * reciprocal(amax): another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (x * inv).round().clamp(-127, 127).to(torch.int8)
    return q, (amax / 127.0).squeeze(-1)


def quantize_row_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows per group of `group` inputs along the last dim (the last one shorter
    where K is not a multiple), as the kernels' quantize_row_s8 -> q [..., K], scales [...,
    ceil(K / group)] float32."""
    k = x.shape[-1]
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k))
    q, scales = quantize_rows(padded.unflatten(-1, (groups, group)))
    return q.flatten(-2)[..., :k], scales


def quantize_int8(w: torch.Tensor) -> QWeight:
    """[..., N, K] -> int8 rows of w rotated along K (hadamard.rotate), a scale per output
    channel."""
    q, scale = quantize_rows(rotate_by_products(w))
    return QWeight("int8", q, scale.unsqueeze(-2).contiguous(), w.shape[-1], w.shape[-1])


INT4_GROUP = 128  # inputs per int4 scale (SPEC section 13), as GPTQ's and AWQ's releases group


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, rotated: bool = True) -> QWeight:
    """[..., N, K] -> int4 values in [-8, 7] (held one per int8 byte, row-major) of w rotated
    along K (unless `rotated` is False), a float32 scale per output channel and group of
    `group` inputs: Q4_0's, the group's value of largest magnitude m over -8 (0: an all-zero
    group)."""
    w = rotate_by_products(w) if rotated else w.float()
    k = w.shape[-1]
    groups = -(-k // group)
    blocks = F.pad(w, (0, groups * group - k)).unflatten(-1, (groups, group))
    at = blocks.abs().argmax(dim=-1, keepdim=True)
    scale = blocks.gather(-1, at) / -8.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = (blocks * inv).round().clamp(-8, 7).to(torch.int8).flatten(-2)[..., :k]
    return int4_from_levels((q + 8).to(torch.uint8), scale.squeeze(-1), None, group, rotated)


def int4_from_levels(
    levels: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    rotated: bool = False,
    perm: torch.Tensor | None = None,
) -> QWeight:
    """A 4-bit weight as published formats give it (GPTQ, AWQ, compressed-tensors once
    unpacked from their int32 words): levels [..., N, K] integers in [0, 15], scales [..., N,
    G] (G = ceil(K / group)), zeros [..., N, G] integer zero points (float or int tensors
    holding whole numbers in [-128, 127]) or None (symmetric: 8), meaning w = (level - zero)
    * scale. group: 32, 64, 128, ... (a multiple of 8) or K (per channel, any K). rotated:
    the levels are of rows rotated by hadamard.rotate (our own --quantization int4); published
    checkpoints are not. perm [..., K]: act-order, column j is input perm[j] (QWeight.perm)."""
    *lead, n, k = levels.shape
    if group <= 0 or (group % 8 and group < k):
        raise ValueError(f"int4 groups must be a multiple of 8 inputs or all of K={k} ({group})")
    g = -(-k // group)  # (a group of K or more: one per channel)
    if tuple(scales.shape) != (*lead, n, g):
        raise ValueError(f"int4 scales have shape {tuple(scales.shape)}, expected {(*lead, n, g)}")
    if levels.dtype.is_floating_point or levels.dtype == torch.bool:
        raise ValueError(f"int4 levels must be integers (got {levels.dtype})")
    if levels.numel() and (int(levels.min()) < 0 or int(levels.max()) > 15):
        raise ValueError("int4 levels must lie in [0, 15]")
    zero = None
    if zeros is not None:
        if tuple(zeros.shape) != (*lead, n, g):
            raise ValueError(
                f"int4 zeros have shape {tuple(zeros.shape)}, expected {(*lead, n, g)}"
            )
        z = zeros.double()
        if not torch.equal(z, z.round()) or (z.numel() and (z.min() < -128 or z.max() > 127)):
            raise ValueError("int4 zero points must be whole numbers in [-128, 127]")
        zero = zeros.to(torch.int8).transpose(-1, -2).contiguous()
    if perm is not None:
        if rotated or tuple(perm.shape) != (*lead, k):
            raise ValueError(f"int4 perm must be [..., {k}] of an unrotated weight")
        perm = perm.to(torch.int32).contiguous()
    return QWeight(
        "int4",
        (levels.to(torch.int16) - 8).to(torch.int8).contiguous(),
        scales.float().transpose(-1, -2).contiguous(),
        group,
        k,
        rotated=rotated,
        zero=zero,
        perm=perm,
    )


MXFP4_GROUP = 32  # inputs per e8m0 scale (OCP MX)
# e2m1 codes -> twice their value, integers (gpt-oss's FP4_VALUES, doubled)
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QWeight:
    """gpt-oss's MXFP4 tensors as published -> an mxfp4 QWeight: blocks uint8 [..., N, K/2]
    (or [..., N, K/32, 16]; input 2i in byte i's low nibble, 2i + 1 in its high one, e2m1
    codes) and scales uint8 e8m0 [..., N, K/32] (2^(e - 127); 255, e8m0's NaN, refused). The
    weight is w[n, k] = e2m1(code) * 2^(e - 127), transformers' dequantization exactly."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales are uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.dim() == scales.dim() + 1:  # [..., N, G, 16]
        blocks = blocks.flatten(-2)
    *lead, n, half = blocks.shape
    k = 2 * half
    if k % MXFP4_GROUP or tuple(scales.shape) != (*lead, n, k // MXFP4_GROUP):
        raise ValueError(
            f"mxfp4 scales have shape {tuple(scales.shape)}, expected {(*lead, n, k // 32)}"
        )
    if scales.numel() and int(scales.max()) == 255:
        raise ValueError("mxfp4 scale 255 (e8m0's NaN)")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    doubled = torch.tensor(E2M1_DOUBLED, dtype=torch.int8)[codes]
    # 2^(e - 128): the doubled values' scale (subnormal below e = 2, still exact)
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 128)
    return QWeight(
        "mxfp4",
        doubled.contiguous(),
        scale.transpose(-1, -2).contiguous(),
        MXFP4_GROUP,
        k,
        rotated=False,
    )


def quantize_fp8(w: torch.Tensor, group: int = FP8_BLOCK) -> QWeight:
    """[..., N, K] -> fp8 e4m3 with a scale per output channel and group of `group` inputs
    (amax / 448 each): per channel alone, e4m3's 3 mantissa bits cost SmolLM2 2.3% of
    perplexity, groups of 128 (as DeepSeek-V3's and Qwen3's FP8 checkpoints group) less."""
    w = w.float()
    k = w.shape[-1]
    groups = -(-k // group)
    blocks = F.pad(w, (0, groups * group - k)).unflatten(-1, (groups, group))
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)[..., :k]
    return QWeight(
        "fp8", q.contiguous(), scale.squeeze(-1).transpose(-1, -2).contiguous(), group, k
    )


def quantize(w: torch.Tensor, fmt: str) -> QWeight:
    if fmt == "int4":
        return quantize_int4(w)
    return quantize_int8(w) if fmt == "int8" else quantize_fp8(w)


def checkpoint_fp8_scales(
    scale: torch.Tensor, shape: tuple[int, int], inverse_block: bool
) -> tuple[torch.Tensor, int]:
    """A published FP8 tensor's scales -> per-row group scales [N, G] and the group size.
    inverse_block: DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv` [ceil(N/128), ceil(K/128)]
    (multiplied in, despite its name); else compressed-tensors' `weight_scale`: one value
    (per tensor) or one per output channel ([N] or [N, 1])."""
    n, k = shape
    scale = scale.float()
    if inverse_block:
        blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        if tuple(scale.shape) != blocks:
            raise ValueError(f"weight_scale_inv has shape {tuple(scale.shape)}, expected {blocks}")
        return scale.repeat_interleave(FP8_BLOCK, dim=0)[:n], FP8_BLOCK
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1), k
    if scale.numel() == n:
        return scale.reshape(n, 1), k
    raise ValueError(f"weight_scale has shape {tuple(scale.shape)}; expected a scalar or [{n}]")


# ---- the torch path --------------------------------------------------------------------------


def linear(
    x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, scaled_mm: bool | None = None
) -> torch.Tensor:
    """x [..., K] times a row-major QWeight (+ bias) -> [..., N] in x's dtype.
    int8: W8A8, x rotated and quantized per group of INT8_ACT_GROUP inputs, each group's
    exact integer sums (in float64) times its scale, added group by group in float32, then
    times the weight's scale: the kernels' order (their adds are fused multiply-adds: within
    a float32 rounding a group); INT8_ACT_GROUP 0: one scale a row, each row's exact sums
    times it, then the weight's: the kernels' floats.
    int4: W4A8, x quantized as for int8 (rotated where the weight is); each group's exact
    integer sums times the group's scale, added group by group in float32, then times the
    row's scale: csrc/int4.c's floats, in its order.
    fp8: on CUDA (or with scaled_mm=True) x quantized per row to fp8 and torch._scaled_mm
    with row-wise scales, where the weight has one scale per channel; else weight-only."""
    rows = x.reshape(-1, x.shape[-1])
    if w.fmt == "int8":
        y = _int8_products(rows, w) * w.scale[0]
    elif w.fmt in FOUR_BIT:
        y = _int4_products(rows, w)
    else:
        use_scaled = x.device.type == "cuda" if scaled_mm is None else scaled_mm
        if use_scaled and w.scale.shape[-2] == 1:
            y = _fp8_scaled_mm(rows, w)
        else:
            y = F.linear(rows.float(), w.dequantize(torch.float32))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def quantize_activations(rows: torch.Tensor, w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, K] as an int8/int4 weight takes them: gathered into the weight's input order
    where it has one (act-order), rotated where the weight is, then int8 per row
    (quantize_rows) -> q [M, K] int8, scales [M] float32."""
    rows = rows.float()
    if w.perm is not None:
        rows = rows.index_select(-1, w.perm)
    return quantize_rows(rotate(rows) if w.rotates else rows)


def _int8_products(rows: torch.Tensor, w: QWeight) -> torch.Tensor:
    """rows [M, K] times a row-major int8 weight's integers, each activation scale applied
    (the weight's not yet) -> [M, N] float32, in the kernels' order."""
    x = rotate(rows.float())
    if not INT8_ACT_GROUP or x.shape[-1] <= INT8_ACT_GROUP:
        q, sx = quantize_rows(x)
        sums = q.double() @ w.data.double().t()  # exact: the kernels' int32 sums
        return sums.float() * sx.unsqueeze(-1)
    q, sx = quantize_row_groups(x, INT8_ACT_GROUP)
    acc = torch.zeros(q.shape[0], w.out_features, dtype=torch.float32, device=rows.device)
    for g, start in enumerate(range(0, q.shape[-1], INT8_ACT_GROUP)):
        part = slice(start, start + INT8_ACT_GROUP)
        sums = q[:, part].double() @ w.data[:, part].double().t()  # exact: at most 516,128
        acc = acc + sums.float() * sx[:, g : g + 1]
    return acc


def _int4_products(rows: torch.Tensor, w: QWeight) -> torch.Tensor:
    """rows [M, K] times a row-major int4 / mxfp4 weight -> [M, N] float32, W4A8 in
    csrc/int4.c's order: acc = 0; acc += float(group's exact sum of integers(w) * q) * group
    scale, group by group; y = acc * sx."""
    q, sx = quantize_activations(rows, w)
    values = w.integers()
    # the group sums are exact integers: in float32 where no sum can reach 2^24 (any order of
    # adding is then exact) and float32 products are not lowered (TF32, bf16), else float64
    bound = 127 * int(values.abs().max()) * min(w.group, w.in_features) if values.numel() else 0
    full = torch.get_float32_matmul_precision() == "highest"
    exact = torch.float32 if bound < 2**24 and full else torch.float64
    q, values = q.to(exact), values.to(exact)
    acc = torch.zeros(q.shape[0], w.out_features, dtype=torch.float32, device=rows.device)
    for g, start in enumerate(range(0, w.in_features, w.group)):
        part = slice(start, start + w.group)
        sums = q[:, part] @ values[:, part].t()  # exact integer sums
        acc = acc + sums.float() * w.scale[g]
    return acc * sx.unsqueeze(-1)


def _fp8_scaled_mm(rows: torch.Tensor, w: QWeight) -> torch.Tensor:
    amax = rows.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    sx = amax / FP8_MAX
    xq = (rows.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(xq, w.data.t(), scale_a=sx, scale_b=w.scale, out_dtype=torch.float32)
