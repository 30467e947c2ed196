"""Paged attention over a flattened batch: decode rows first, then prefill chunks.

Decode rows gather their context slots for SDPA; prefill chunks use SDPA (flash attention on
CPU and GPU). A backend may read the paged cache in place instead (kernels/modules.py: block
tables, no gathered copy); the model runner then builds the metadata it reads.

Shapes: T tokens in the step, H query heads, G kv heads, d head dim, S cache slots,
B_d decode rows, L longest decode context, W block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference.models.layers import apply_rope
from inference.models.paged_cache import gather_slots, write_kv


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    length: int  # query tokens in the chunk
    context_len: int  # tokens already in the cache before the chunk
    slots: torch.Tensor | None  # [context_len + length] cache slots; None when context_len == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer. Decode rows come
    with block tables (a backend reading the cache in place) or gathered slots and a mask
    (SDPA)."""

    slot_mapping: torch.Tensor  # [T] where each new token's k/v is written
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_slots: torch.Tensor | None  # [B_d, L] cache slots of each decode row's context
    # [B_d, 1, 1, L] True where the slot is part of the context; None: one row
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    block_tables: torch.Tensor | None = None  # [B_d, W] int32, the decode rows' cache blocks
    context_lens: torch.Tensor | None = None  # [B_d] int32, their context lengths (new token in)
    block_size: int = 0


class PagedAttention(nn.Module):
    """Rotates the step's queries and keys, writes its keys and values into the paged cache
    and attends: decode rows over their cached context, prefill chunks causally. A backend
    overrides rope_and_write (a fused kernel) and decode (reading the cache in place)."""

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, scale

    def forward(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """qkv [T, H + 2G, d] -> [T, H, d]."""
        q, k, v = self.rope_and_write(qkv, cos, sin, meta, k_cache, v_cache)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        nd = meta.num_decode
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = prefill_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, self.scale
            )
        return out

    def rope_and_write(self, qkv, cos, sin, meta, k_cache, v_cache):
        """-> q [T, H, d], k and v [T, G, d], k and v written to the caches."""
        h, g = self.num_heads, self.num_kv_heads
        qk = apply_rope(qkv[:, : h + g], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + g :]
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        return q, k, v

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Single-token queries q [B_d, H, d] over their gathered context slots -> [B_d, H, d]."""
        keys = gather_slots(k_cache, meta.decode_slots, q.dtype).transpose(1, 2)  # [B_d, G, L, d]
        values = gather_slots(v_cache, meta.decode_slots, q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """One prompt chunk's queries q [c, H, d] (keys and values k, v [c, G, d], already in the
    caches, in any KV format: read back dequantized) -> [c, H, d_v]."""
    qc = q.transpose(0, 1).unsqueeze(0)  # [1, H, c, d]
    if chunk.slots is None:  # fresh prompt: the chunk attends to itself, causally
        kc, vc, mask, causal = k, v, None, True
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
    return o.squeeze(0).transpose(0, 1)
