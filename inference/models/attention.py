"""Paged attention over a flattened batch: decode rows first, then prefill chunks.

Decode rows read the paged cache in place through our CPU kernel (block tables, no gathered
copy) when the model runs on the CPU kernels, else gather their context slots for SDPA.
Prefill chunks use SDPA (flash attention on CPU and GPU).

Shapes: T tokens in the step, H query heads, G kv heads, d head dim, S cache slots,
B_d decode rows, L longest decode context, W block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.kernels import cpu as cpu_kernels
from inference.models.paged_cache import gather_slots


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    length: int  # query tokens in the chunk
    context_len: int  # tokens already in the cache before the chunk
    slots: torch.Tensor | None  # [context_len + length] cache slots; None when context_len == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer. Decode rows come
    with block tables (the CPU kernel) or gathered slots and a mask (SDPA)."""

    slot_mapping: torch.Tensor  # [T] where each new token's k/v is written
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_slots: torch.Tensor | None  # [B_d, L] cache slots of each decode row's context
    decode_mask: (
        torch.Tensor | None
    )  # [B_d, 1, 1, L] True where the slot is part of the context; None: one row
    prefills: list[PrefillChunk]
    block_tables: torch.Tensor | None = None  # [B_d, W] int32, the decode rows' cache blocks
    context_lens: torch.Tensor | None = (
        None  # [B_d] int32, their context lengths (the new token included)
    )
    block_size: int = 0


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, d]; k, v [T, G, d] (already written to the caches, in any KV format: read
    back dequantized). Returns [T, H, d_v]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    nd = meta.num_decode
    if nd and meta.block_tables is not None:
        out[:nd] = cpu_kernels.decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size, scale
        )
    elif nd:
        keys = gather_slots(k_cache, meta.decode_slots, q.dtype).transpose(1, 2)  # [B_d, G, L, d]
        values = gather_slots(v_cache, meta.decode_slots, q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),
            keys,
            values,
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=True,
        )
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, c, d]
        if chunk.slots is None:  # fresh prompt: the chunk attends to itself, causally
            kc, vc, mask, causal = k[rows], v[rows], None, True
        else:  # continuing a chunked or prefix-cached prompt: read the whole context
            kc = gather_slots(k_cache, chunk.slots, q.dtype)
            vc = gather_slots(v_cache, chunk.slots, q.dtype)
            total = chunk.context_len + chunk.length
            query_pos = torch.arange(chunk.context_len, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            qc,
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
