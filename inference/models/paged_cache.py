"""The rows of the paged KV tensors, as attention writes and reads them: slot = block *
block_size + offset. Per layer, one tensor per entry of ModelArgs.kv_cache_shapes: a key and
a value cache [slots, kv_heads, head_dim], or for MLA a single latent cache [slots, 1,
kv_lora_rank + qk_rope_head_dim] (allocated by executor/kv_cache.py).

Formats (--kv-cache-dtype): "auto" stores the model's dtype; "int8", "fp8_e4m3" and
"fp8_e5m2" store each (slot, head) row as 8-bit values scaled by the row's amax (to 127, or
the fp8 format's largest value) with the scale written after them as bf16: [slots, heads,
width + 2] elements of one byte, about half of bf16's bytes. The fp8 rows need the scale
too: unscaled (vLLM's default k_scale of 1), SmolLM2's values fall into e4m3's subnormals
and cost 0.8% of perplexity. Rows are quantized where they are written and dequantized
where attention reads them (the CPU kernels in C, here in torch).

An 8-bit row is stored rotated (hadamard.py: its values times the normalized Hadamard
matrix of each power-of-two block of the width, largest first; MLA's 576 = 512 + 64). A few
channels of keys carry most of their size; rotated, every value carries a share of it, and
fp8's error, relative to each value, costs attention less (SmolLM2 perplexity, fp8_e4m3:
+0.58% unrotated, +0.35% rotated; e5m2 +2.47% and +1.91%; int8 +0.056% either way). The
reads rotate back: dequantize() here, and the C kernels rotate the queries instead and
their outputs back (q . k = Rq . Rk), a few rows where the context has thousands.
"""

from __future__ import annotations

import torch

from inference.quantization.hadamard import rotate, rotation_blocks, rotation_matrix

_STORAGE = {
    "int8": torch.uint8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_LIMIT = {torch.uint8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 2  # an 8-bit row's bf16 scale


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def stores_8bit(storage: torch.dtype) -> bool:
    """Whether cache rows of this storage dtype are 8-bit values with a scale."""
    return storage in _LIMIT


def row_width(width: int, storage: torch.dtype) -> int:
    """Elements of storage per (slot, head) row holding `width` values."""
    return width + SCALE_BYTES if storage in _LIMIT else width


def kv_width(cache: torch.Tensor) -> int:
    """Values per (slot, head) row."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype in _LIMIT else 0)


def rotates_alone(first: int, width: int) -> bool:
    """Whether the first `first` values of a row of `width` rotate as a row of their own (an
    MLA latent's values before its rope part; attention reads them back as values)."""
    blocks = rotation_blocks(first)
    return rotation_blocks(width)[: len(blocks)] == blocks


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """cache [S, G, row]; kv [T, G, d], quantized to the cache's format (8-bit: rotated
    first)."""
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
    """Cache rows [..., row] in any format -> their values [..., width] in `dtype` (8-bit:
    rotated back)."""
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
    raw = cache.view(torch.uint8) if cache.dtype in _LIMIT else cache  # fp8: as bytes, as above
    rows = raw.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
    return dequantize(rows.view(cache.dtype), dtype)
