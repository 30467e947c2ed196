"""Paged attention over a flattened batch: decode rows first, then prefill chunks.

Decode rows gather their context slots for SDPA; prefill chunks attend to their cached prefix
and to themselves in flash-attention parts (attention_parts.py). A backend may read the paged cache in place instead (kernels/modules.py: block
tables, no gathered copy); the model runner then builds the metadata it reads.

Shapes: T tokens in the step, H query heads, G kv heads, d head dim, S cache slots,
B_d decode rows, L longest decode context, W block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference.models.attention_parts import chunk_attention
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
    overrides rope_and_write (a fused kernel), prefill and decode (reading the cache in place).

    window > 0: a sliding-window layer, each query sees its last `window` positions (itself
    included). sinks: a learned logit per head that joins each softmax's denominator with no
    value (gpt-oss's attention sinks), loaded into `sinks` [H]. key_shift [G, d] float32, or
    None: taken off every key after RoPE, before it is written or attended (the int4 cache's;
    softmax-invariant); key_hinv [G, d, d] float32, or None: how its int4 key rows round
    (paged_cache.quantize_int4's weights). Both from executor/key_calibration.py."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, scale: float, window: int = 0, sinks: bool = False
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, scale
        self.window = window
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.register_buffer("key_shift", None, persistent=False)
        self.register_buffer("key_hinv", None, persistent=False)

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
            out[rows] = self.prefill(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta.slot_mapping[rows]
            )
        return out

    def rope_and_write(self, qkv, cos, sin, meta, k_cache, v_cache):
        """-> q [T, H, d], k and v [T, G, d], k and v written to the caches."""
        h, g = self.num_heads, self.num_kv_heads
        qk = apply_rope(qkv[:, : h + g], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + g :]
        if self.key_shift is not None:
            k = (k.float() - self.key_shift).to(k.dtype)
        write_kv(k_cache, meta.slot_mapping, k, self.key_hinv)
        write_kv(v_cache, meta.slot_mapping, v)
        return q, k, v

    def prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk, new_slots) -> torch.Tensor:
        """A prompt chunk's queries q [c, H, d] (its keys and values k, v [c, G, d], written
        to the caches at `new_slots` [c]) over its prefix and itself -> [c, H, d]."""
        return prefill_attention(
            q, k, v, k_cache, v_cache, chunk, self.scale, self.window, self.sinks
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Single-token queries q [B_d, H, d] over their gathered context slots -> [B_d, H, d]."""
        keys = gather_slots(k_cache, meta.decode_slots, q.dtype).transpose(1, 2)  # [B_d, G, L, d]
        values = gather_slots(v_cache, meta.decode_slots, q.dtype).transpose(1, 2)
        mask = meta.decode_mask
        if self.window:
            positions = torch.arange(keys.shape[2], device=q.device)
            lens = keys.shape[2] if mask is None else mask.sum(-1, keepdim=True)
            recent = positions >= lens - self.window
            mask = recent if mask is None else mask & recent
        return attend(q.unsqueeze(2), keys, values, mask, self.scale, self.sinks).squeeze(2)


def attend(q, k, v, mask, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of decode rows q [B, H, c, d] over k, v [B, G, L, d] (mask: True where allowed, or None).
    Sinks [H] join as one more key per head whose score is the sink and whose value is zero:
    its logit is an additive mask over a zero key, so SDPA's own kernels still run."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, c, _ = q.shape
    length = k.shape[2]
    allowed = torch.ones((), dtype=torch.bool, device=q.device) if mask is None else mask
    bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    bias = torch.cat(
        (bias.expand(b, h, c, length), sinks.to(q.dtype).view(1, h, 1, 1).expand(b, h, c, 1)),
        dim=-1,
    )
    zero = k.new_zeros(b, k.shape[1], 1, k.shape[3])
    k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero[..., : v.shape[3]]), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One prompt chunk's queries q [c, H, d] (keys and values k, v [c, G, d], already in the
    caches, in any KV format: a continuing chunk reads them back dequantized, as it reads
    its prefix) -> [c, H, d_v]. window and sinks as PagedAttention's. The chunk attends to
    its prefix and to itself in parts (attention_parts.py): no mask or scores as wide as
    the context, and of the prefix only what the window reaches is read."""
    if chunk.slots is None:  # a fresh prompt: the chunk attends to itself
        k_prev = v_prev = None
    else:  # continuing a chunked or prefix-cached prompt: its prefix from the cache
        first = max(0, chunk.context_len - window + 1) if window else 0  # earliest key seen
        slots = chunk.slots[first:]
        kc, vc = gather_slots(k_cache, slots, q.dtype), gather_slots(v_cache, slots, q.dtype)
        split = chunk.context_len - first
        k_prev, v_prev, k, v = kc[:split], vc[:split], kc[split:], vc[split:]
    o = chunk_attention(
        _heads(q),
        _heads(k),
        _heads(v),
        None if k_prev is None else _heads(k_prev),
        None if v_prev is None else _heads(v_prev),
        scale,
        window,
        sinks,
    )
    return o.squeeze(0).transpose(0, 1)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, d] -> [1, heads, n, d] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)
