"""4-bit levels, scales and zero points for a weight at load, data-free (no calibration set).

Every weight row is cut into groups of `group` inputs; each group keeps levels l in [0, 15]
and reads back as w ~ scale * (l - zero) (llama.cpp's Q4_K writes the same as d * l - m,
m = d * zero). Three ways to choose scale and zero:

- `symmetric`: Q4_0's, zero = 8 and the value of largest magnitude landing on -8 exactly.
- `minmax`: the group's min and max on levels 0 and 15.
- `search` (the default): llama.cpp's make_qkx2_quants (Q4_K's, ggml-quants.c): from the
  min/max grid, 21 stretched grids (iscale = (15 + rmin + rdelta * i) / (max - min)), each
  rounded, then scale and min refitted by weighted least squares; the grid with the least
  weighted squared error is kept. The weights are llama.cpp's data-free importance, av + |w|
  (av: the group's rms), so the large values a 4-bit grid cuts off or rounds the most count
  more. Like Q4_K it keeps the grid's min at or below 0 (zero >= 0).

`integer_zeros` keeps each zero a whole level (GPTQ's and AWQ's integer zero points, which
qweight.int4_from_levels and the kernels take): the search rounds each candidate's zero and
refits its scale before weighing it. All of it is elementwise over the groups, 21 passes:
data-free and fast enough at load. SmolLM2-135M's figures per method are in bench/NOTES.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.quantization.hadamard import rotate_by_products
from inference.quantization.qweight import QWeight, int4_from_levels

LEVELS = 15  # the largest 4-bit level
METHODS = ("symmetric", "minmax", "search")
CHUNK = 1 << 22  # values quantized at once (quantize_int4_levels)


@dataclass
class Int4Levels:
    levels: torch.Tensor  # uint8 [..., N, K] in [0, 15]
    scales: torch.Tensor  # float32 [..., N, G]
    zeros: torch.Tensor | None  # float32 [..., N, G] (whole numbers with integer_zeros); None: 8
    group: int

    def dequantize(self) -> torch.Tensor:
        """w ~ scale * (level - zero), float32 [..., N, K]."""
        k = self.levels.shape[-1]
        zeros = self.zeros if self.zeros is not None else torch.full_like(self.scales, 8.0)
        scale = self.scales.repeat_interleave(self.group, dim=-1)[..., :k]
        zero = zeros.repeat_interleave(self.group, dim=-1)[..., :k]
        return scale * (self.levels.float() - zero)


def quantize_int4_levels(
    w: torch.Tensor,
    group: int = 128,
    method: str = "search",
    integer_zeros: bool = False,
    steps: int = 20,
) -> Int4Levels:
    """w [..., N, K] (any float dtype) -> Int4Levels: groups of `group` inputs along K (a last,
    shorter group padded with zeros, which read back exactly), levels by `method`. Rows are
    quantized CHUNK values at a time: the search holds several float32 copies of what it
    works on, and an MoE layer's stacked experts are hundreds of millions of values."""
    if method not in METHODS:
        raise ValueError(f"int4 method {method!r}: expected one of {', '.join(METHODS)}")
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    step = max(1, CHUNK // max(k, 1))
    if rows.shape[0] > step:
        parts = [
            quantize_int4_levels(rows[i : i + step], group, method, integer_zeros, steps)
            for i in range(0, rows.shape[0], step)
        ]
        lead = w.shape[:-1]
        return Int4Levels(
            torch.cat([p.levels for p in parts]).reshape(*lead, k),
            torch.cat([p.scales for p in parts]).reshape(*lead, -1),
            None
            if parts[0].zeros is None
            else torch.cat([p.zeros for p in parts]).reshape(*lead, -1),
            group,
        )
    groups = -(-k // group)
    blocks = F.pad(w.float(), (0, groups * group - k)).unflatten(-1, (groups, group))
    if method == "symmetric":
        at = blocks.abs().argmax(dim=-1, keepdim=True)
        scale = blocks.gather(-1, at) / -8.0
        inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        levels = ((blocks * inv).round().clamp(-8, 7) + 8).to(torch.uint8)
        return Int4Levels(_rows(levels, k), scale.squeeze(-1), None, group)
    if method == "minmax":
        scale, lo = _minmax(blocks)
    else:
        scale, lo = _search(blocks, steps, integer_zeros)
    zero = _zero(scale, lo, integer_zeros)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    levels = (blocks * inv + zero).round().clamp(0, LEVELS)
    return Int4Levels(_rows(levels.to(torch.uint8), k), scale.squeeze(-1), zero.squeeze(-1), group)


def _rows(levels: torch.Tensor, k: int) -> torch.Tensor:
    return levels.flatten(-2)[..., :k].contiguous()


def _minmax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo = blocks.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = blocks.amax(dim=-1, keepdim=True).clamp(min=0)
    return (hi - lo) / LEVELS, lo


def _zero(scale: torch.Tensor, lo: torch.Tensor, integer: bool) -> torch.Tensor:
    """The level that reads back as 0: -lo / scale (0 for an all-zero group)."""
    zero = torch.where(scale > 0, -lo / scale, torch.zeros_like(scale)).clamp(0, LEVELS)
    return zero.round() if integer else zero


def _search(
    blocks: torch.Tensor, steps: int, integer_zeros: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qkx2_quants(n, 15, x, av + |x|, rmin=-1, rdelta=0.1, nstep=steps) on every group
    at once -> (scale, min), min <= 0, each [..., G, 1]. With integer_zeros each candidate's
    zero is rounded to a whole level and its scale refitted before its error is weighed, so
    the grid kept is the best of those the kernel can hold."""
    weights = blocks.pow(2).mean(dim=-1, keepdim=True).sqrt() + blocks.abs()
    sum_w = weights.sum(-1, keepdim=True)
    sum_x = (weights * blocks).sum(-1, keepdim=True)
    lo = blocks.amin(dim=-1, keepdim=True).clamp(max=0)
    span = blocks.amax(dim=-1, keepdim=True) - lo
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    best_scale, best_min = span / LEVELS, lo.clone()
    if integer_zeros:
        best_scale, best_min = _on_integer_zero(blocks, weights, best_scale, best_min)
    best_err = _error(blocks, weights, best_scale, best_min)
    for step in range(steps + 1):
        iscale = (LEVELS - 1.0 + 0.1 * step) / span
        lv = ((blocks - lo) * iscale).round().clamp(0, LEVELS)
        sum_l = (weights * lv).sum(-1, keepdim=True)
        sum_l2 = (weights * lv * lv).sum(-1, keepdim=True)
        sum_xl = (weights * lv * blocks).sum(-1, keepdim=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        low = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        # a fitted min above 0: Q4_K's rule, min = 0 and the scale refitted alone
        pos = low > 0
        l2 = torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2))
        scale = torch.where(pos, sum_xl / l2, scale)
        low = torch.where(pos, torch.zeros_like(low), low)
        ok = ok & (scale > 0)
        scale = torch.where(ok, scale, best_scale)
        if integer_zeros:
            scale, low = _on_integer_zero(blocks, weights, scale, low)
            ok = ok & (scale > 0)
            scale = torch.where(ok, scale, best_scale)
        err = _error(blocks, weights, scale, low)
        better = ok & (err < best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, low, best_min)
        best_err = torch.where(better, err, best_err)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale, best_min


def _on_integer_zero(blocks, weights, scale, low) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid (scale, low) moved to a whole zero level, its scale refitted (weighted least
    squares, levels and zero fixed) -> (scale, low = -zero * scale)."""
    zero = (-low / scale).round().clamp(0, LEVELS)
    q = ((blocks / scale) + zero).round().clamp(0, LEVELS) - zero
    qq = (weights * q * q).sum(-1, keepdim=True)
    fit = (weights * q * blocks).sum(-1, keepdim=True) / torch.where(
        qq > 0, qq, torch.ones_like(qq)
    )
    scale = torch.where((qq > 0) & (fit > 0), fit, scale)
    return scale, -zero * scale


def _error(blocks, weights, scale, low) -> torch.Tensor:
    lv = ((blocks - low) / scale).round().clamp(0, LEVELS)
    return (weights * (scale * lv + low - blocks).pow(2)).sum(-1, keepdim=True)


def quantize_int4_searched(
    w: torch.Tensor, group: int = 128, method: str = "search", rotated: bool = True
) -> QWeight:
    """[..., N, K] -> an int4 QWeight (qweight.int4_from_levels): the rows rotated along K
    (hadamard.rotate, as int8's, unless `rotated` is False), then levels, scales and integer
    zero points by `method` (symmetric: no zero points, Q4_0's)."""
    rows = rotate_by_products(w) if rotated else w.float()
    q = quantize_int4_levels(rows, group, method, integer_zeros=True)
    return int4_from_levels(q.levels, q.scales, q.zeros, group, rotated)
