"""The rows of the paged KV tensors, as attention writes and reads them: slot = block *
block_size + offset. Per layer, one tensor per entry of ModelArgs.kv_cache_shapes: a key and
a value cache [slots, kv_heads, head_dim], or for MLA a single latent cache [slots, 1,
kv_lora_rank + qk_rope_head_dim] (allocated by executor/kv_cache.py).

Formats (--kv-cache-dtype): "auto" stores the model's dtype; "int8", "fp8_e4m3" and
"fp8_e5m2" store each (slot, head) row as 8-bit values scaled by the row's amax (to 127, or
the fp8 format's largest value) with the scale written after them as bf16: [slots, heads,
width + 2] elements of one byte, about half of bf16's bytes. "int4" stores two values a
byte with a bf16 scale per group of INT4_GROUP values (amax to 7, or a little less where
that holds the group closer: INT4_SCALE_FACTORS), the scales after the
values: [slots, heads, width / 2 + 2 * groups] bytes (torch.uint4 marks the format; its
elements are bytes), 3.56x bf16's tokens in the same bytes. A group of n values packs as
llama.cpp's Q4_0 does, value i and value i + n / 2 in the low and high nibble of byte i,
each as q + 8 (q in [-8, 7]), so a vector of bytes widens into two runs of values. The fp8 rows need the scale
too: unscaled (vLLM's default k_scale of 1), SmolLM2's values fall into e4m3's subnormals
and cost 0.8% of perplexity. Rows are quantized where they are written and dequantized
where attention reads them (the CPU kernels in C, here in torch).

A quantized row is stored rotated (hadamard.py: its values times the normalized Hadamard
matrix of each power-of-two block of the width, largest first; MLA's 576 = 512 + 64). A few
channels of keys carry most of their size; rotated, every value carries a share of it, and
fp8's error, relative to each value, costs attention less (SmolLM2 perplexity, fp8_e4m3:
+0.58% unrotated, +0.35% rotated; e5m2 +2.47% and +1.91%; int8 +0.056% either way). int4
rows are rotated alike (before their groups are scaled). The
reads rotate back: dequantize() here, and the C kernels rotate the queries instead and
their outputs back (q . k = Rq . Rk), a few rows where the context has thousands.
"""

from __future__ import annotations

import functools

import torch

from inference.quantization.hadamard import rotate, rotation_blocks, rotation_matrix

INT4 = torch.uint4  # the int4 cache's storage: bytes, each holding two values
_STORAGE = {
    "int4": INT4,
    "int8": torch.uint8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_LIMIT = {torch.uint8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 2  # an 8-bit row's bf16 scale, and each of an int4 row's
# values per int4 scale (csrc/kernels.h KV_INT4_GROUP): a head of 64 takes 36 bytes, 3.56x
# fewer than bf16's 128. SmolLM2's perplexity cost is nearly all the keys' (values alone:
# +0.3%); scales per 16 values (40 bytes a head, 3.2x) cut it less than the scale search
# (below) does in 36
INT4_GROUP = 32
# A group's scale: amax * f / 7 for the f of these whose levels (-8 to 7) hold the group with
# the least squared error (csrc/kv_rows.c's store_int4 tries the same). A smaller scale than
# amax / 7 clips the largest values but rounds the rest finer: SmolLM2, quant_bench's 32,768
# tokens, perplexity +7.1% -> +5.6% (fake quantization of a float32 model, 8,192 tokens:
# +7.3% -> +5.4%, and +6.1% with the same candidates but levels -7 to 7).
INT4_LIMIT = 7.0
INT4_SCALE_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def stores_quantized(storage: torch.dtype) -> bool:
    """Whether cache rows of this storage dtype are quantized values with scales (stored
    rotated), 8-bit or int4."""
    return storage in _LIMIT or storage == INT4


def row_width(width: int, storage: torch.dtype) -> int:
    """Elements of storage per (slot, head) row holding `width` values."""
    if storage == INT4:
        return width // 2 + SCALE_BYTES * -(-width // INT4_GROUP)
    return width + SCALE_BYTES if storage in _LIMIT else width


@functools.cache
def _int4_width(row: int) -> int:
    # row_width grows with the width, so exactly one even width gives `row` bytes
    return next(w for w in range(2, 2 * row + 1, 2) if row_width(w, INT4) == row)


def kv_width(cache: torch.Tensor) -> int:
    """Values per (slot, head) row."""
    if cache.dtype == INT4:
        return _int4_width(cache.shape[-1])
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype in _LIMIT else 0)


def rotates_alone(first: int, width: int) -> bool:
    """Whether the first `first` values of a row of `width` rotate as a row of their own (an
    MLA latent's values before its rope part; attention reads them back as values)."""
    blocks = rotation_blocks(first)
    return rotation_blocks(width)[: len(blocks)] == blocks


def reads_alone(first: int, width: int, storage: torch.dtype) -> bool:
    """Whether attention can read the first `first` values of cache rows of `width` as values
    of their own: whole rotation blocks (quantized rows) and, for int4, whole scale groups."""
    if not stores_quantized(storage) or first == width:
        return True
    return rotates_alone(first, width) and (storage != INT4 or first % INT4_GROUP == 0)


def _groups(width: int) -> list[tuple[int, int]]:
    """An int4 row's scale groups: (first value, values), the last one possibly shorter."""
    return [(g, min(INT4_GROUP, width - g)) for g in range(0, width, INT4_GROUP)]


def quantize_int4(kv: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """kv [..., d] (d even) -> int4 rows [..., row] as bytes: rotated, a bf16 scale per group
    (of INT4_SCALE_FACTORS' candidates, the one whose levels hold the group with the least
    squared error), values rounded to nearest even and stored + 8, Q4_0's nibble order (see
    the module's docstring). csrc/kv_rows.c writes the same bytes.

    weights [G, d, d] float32 (kv [..., G, d]), or None: each head's rows rounded as GPTQ
    rounds a weight row (_weighted_levels), for the error a query sees, not the squared one."""
    d = kv.shape[-1]
    if d % 2:
        raise ValueError(f"an int4 cache row needs an even number of values, not {d}")
    x = rotate(kv.float())
    levels, scales = [], []
    for g, n in _groups(d):
        scale, q = _int4_group(x[..., g : g + n])
        levels.append(q)
        scales.append(scale)
    if weights is not None:
        each = torch.cat(
            [s.float().expand(*s.shape[:-1], n) for s, (_, n) in zip(scales, _groups(d))], -1
        )
        levels = list(_weighted_levels(x, each, weights).split([n for _, n in _groups(d)], -1))
    packed = []
    for q in levels:
        q = q.to(torch.uint8) + 8
        half = q.shape[-1] // 2
        packed.append(q[..., :half] | (q[..., half:] << 4))
    values = torch.cat(packed, dim=-1)
    return torch.cat((values, torch.cat(scales, dim=-1).view(torch.uint8)), dim=-1)


def _weighted_levels(x: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rotated rows x [..., G, d] at their values' scales [..., G, d] -> levels [..., G, d],
    -8..7: value by value, each rounded to nearest even and its error carried into the values
    after it as GPTQ carries a weight's (weights [G, d, d]: the upper Cholesky factor of the
    inverse of the head's query second moment, in the rotated space: executor/
    key_calibration.py). Carried in float64 with each error rounded to float32 first, so each
    product is exact and an fma changes nothing: csrc/kv_rows.c's int4_weighted_levels gives
    the same levels."""
    w, h, s = x.double(), weights.double(), scales.double()
    levels = torch.empty_like(x)
    for i in range(x.shape[-1]):
        si = s[..., i]
        level = torch.where(si > 0, w[..., i] / torch.where(si > 0, si, 1.0), 0.0)
        level = level.clamp(-8, 7).round()
        levels[..., i] = level.float()
        if i + 1 < x.shape[-1]:
            err = ((w[..., i] - level * si) / h[:, i, i]).float().double()
            w[..., i + 1 :] -= err[..., None] * h[:, i, i + 1 :]
    return levels


def _int4_group(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's values [..., n] (rotated, float32) -> (bf16 scale [..., 1], levels [..., n]):
    each candidate scale bf16(amax * f / 7) quantizes the group, and the first with the least
    squared error is kept: each value's error in float32 (the level times the scale is exact
    there), squared and summed in float64, as csrc/kv_rows.c's int4_levels."""
    amax = part.abs().amax(dim=-1, keepdim=True)
    best = None
    for f in INT4_SCALE_FACTORS:
        scale = (amax * f / INT4_LIMIT).to(torch.bfloat16)
        s = scale.float()
        q = torch.where(s > 0, part / torch.where(s > 0, s, 1.0), 0.0).clamp(-8, 7).round()
        err = (q * s - part).double().square().sum(dim=-1, keepdim=True)
        if best is None:
            best = scale, q, err
            continue
        better = err < best[2]
        best = (
            torch.where(better, scale, best[0]),
            torch.where(better, q, best[1]),
            torch.where(better, err, best[2]),
        )
    return best[0], best[1]


def dequantize_int4(raw: torch.Tensor) -> torch.Tensor:
    """int4 rows [..., row] as bytes -> their values [..., width], float32, still rotated."""
    d = _int4_width(raw.shape[-1])
    scales = raw[..., d // 2 :].contiguous().view(torch.bfloat16).float()
    low = (raw[..., : d // 2] & 15).float() - 8.0
    high = (raw[..., : d // 2] >> 4).float() - 8.0
    full = d // INT4_GROUP * INT4_GROUP  # whole groups at once, then a shorter last one
    parts = []
    if full:
        shape = (*raw.shape[:-1], full // INT4_GROUP, INT4_GROUP // 2)
        pair = torch.cat(
            (low[..., : full // 2].view(shape), high[..., : full // 2].view(shape)), -1
        )
        parts.append((pair * scales[..., : full // INT4_GROUP, None]).flatten(-2))
    if full < d:
        s = scales[..., -1:]
        parts += [low[..., full // 2 :] * s, high[..., full // 2 :] * s]
    return torch.cat(parts, dim=-1)


def write_kv(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> None:
    """cache [S, G, row]; kv [T, G, d], quantized to the cache's format (8-bit and int4:
    rotated first; int4 rows rounded by `weights` where given: quantize_int4)."""
    if cache.dtype == INT4:
        cache.view(torch.uint8).index_copy_(0, slot_mapping, quantize_int4(kv, weights))
        return
    limit = _LIMIT.get(cache.dtype)
    if limit is None:
        cache.index_copy_(0, slot_mapping, kv)
        return
    x = rotate(kv.float())
    # the scale as stored (bf16), so that reading multiplies by exactly what divided
    scale = (x.abs().amax(dim=-1, keepdim=True) / limit).to(torch.bfloat16)
    s = scale.float()
    scaled = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).clamp(-limit, limit)
    values = scaled.round().to(torch.int8) if cache.dtype == torch.uint8 else scaled.to(cache.dtype)
    rows = torch.cat((values.view(torch.uint8), scale.view(torch.uint8)), dim=-1)
    # as bytes: torch has no CPU index_copy_ for fp8
    cache.view(torch.uint8).index_copy_(0, slot_mapping, rows)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] in any format -> their values [..., width] in `dtype` (8-bit and
    int4: rotated back)."""
    if rows.dtype == INT4:
        values = dequantize_int4(rows.view(torch.uint8))
        return (values @ rotation_matrix(values.shape[-1], rows.device)).to(dtype)
    if rows.dtype not in _LIMIT:
        return rows.to(dtype)
    raw = rows.view(torch.uint8)
    values = raw[..., :-SCALE_BYTES]
    values = values.view(torch.int8) if rows.dtype == torch.uint8 else values.view(rows.dtype)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
    return ((values.float() * scale) @ rotation_matrix(values.shape[-1], rows.device)).to(dtype)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [S, G, row], slots [...] -> the values [..., G, d] in `dtype`; index_select is
    several times faster than advanced indexing on CPU."""
    # fp8 and int4: as bytes, as above
    raw = cache.view(torch.uint8) if stores_quantized(cache.dtype) else cache
    rows = raw.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
    return dequantize(rows.view(cache.dtype), dtype)
