"""Multi-head latent attention (DeepSeek-V2, V2-Lite) over the paged cache.

Shapes: T tokens, H heads, r kv_lora_rank, n qk_nope_head_dim, p qk_rope_head_dim,
v v_head_dim, L context length, B_d decode rows.

Each token caches ONE row of r + p values: the normalised compressed latent c_kv and the
roped key part k_pe shared by all heads (cache [S, 1, r + p]), not H expanded keys and values;
that is the point of MLA. Keys and values are rebuilt from the latent with kv_b_proj:
- prefill chunks expand the context's latents into per-head keys and values (as the
  reference does) and attend to their prefix and to themselves (attention_parts.py);
- decode rows use the absorbed form: W_UK is folded into the query (q_nope W_UK -> [H, r]),
  so the query attends directly over the cached rows, as one-kv-head attention with keys
  [c_kv, k_pe] and values c_kv, and W_UV is applied to the [H, r] result. Same product,
  without expanding the whole context every step (AbsorbedAttention; a backend may replace
  it: on the CPU kernels the two absorbed projections are per-head products on prepacked
  W_UK^T and W_UV, and the attention reads the latent cache in place).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inference.models.args import ModelArgs, rules
from inference.models.attention import AttentionMetadata
from inference.models.attention_parts import chunk_attention
from inference.models.layers import Linear, RMSNorm, apply_rope_interleaved
from inference.models.paged_cache import gather_slots, write_kv

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the reference's default eps


def softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when set."""
    scale = qk_head_dim**-0.5
    rope = rope_parameters or {}
    factor, mscale_all_dim = rope.get("factor") or 1.0, rope.get("mscale_all_dim") or 0.0
    if rope.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, d = args.num_heads, args.hidden_size
        self.num_heads, self.kv_lora_rank = h, args.kv_lora_rank
        self.rope_dim, self.v_dim = args.qk_rope_head_dim, args.v_head_dim
        self.nope_dim = args.head_dim - args.qk_rope_head_dim
        q_out = h * args.head_dim
        self.q_lora = bool(args.q_lora_rank)
        if self.q_lora:  # low-rank query: q_a_proj -> q_a_layernorm -> q_b_proj
            self.wq_a = Linear(d, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_norm = RMSNorm(args.q_lora_rank, _LATENT_NORM_EPS)
            self.wq_b = Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = Linear(d, q_out, bias=False)
        self.wkv_a = Linear(d, args.kv_lora_rank + self.rope_dim, bias=args.qkv_bias)
        self.kv_a_norm = RMSNorm(args.kv_lora_rank, _LATENT_NORM_EPS)
        self.wkv_b = Linear(args.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.wo = Linear(h * self.v_dim, d, bias=args.o_bias)
        self.scale = softmax_scale(args.head_dim, getattr(args.hf_config, "rope_parameters", None))
        self.absorbed = AbsorbedAttention(
            h, self.nope_dim, self.v_dim, args.kv_lora_rank, self.scale
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        t, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q_nope, q_pe = q.view(t, h, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        q_pe = apply_rope_interleaved(q_pe, cos, sin)
        c_kv, k_pe = self.wkv_a(x).split((r, self.rope_dim), dim=-1)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(1), cos, sin)
        latent = torch.cat((self.kv_a_norm(c_kv).unsqueeze(1), k_pe), dim=-1)  # [T, 1, r + p]
        write_kv(cache, meta.slot_mapping, latent)
        out = x.new_empty(t, h, self.v_dim)
        nd = meta.num_decode
        if nd:
            out[:nd] = self.absorbed(q_nope[:nd], q_pe[:nd], cache, meta, self.wkv_b.weight)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            ctx = latent[rows] if chunk.slots is None else gather_slots(cache, chunk.slots, x.dtype)
            k, v = self._expand(ctx)  # [n, H, n + p], [n, H, v]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            split = 0 if chunk.slots is None else chunk.context_len  # the prefix: no mask
            qc = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)  # [H, c, n + p]
            o = chunk_attention(
                qc.unsqueeze(0),
                k[:, :, split:],
                v[:, :, split:],
                k[:, :, :split] if split else None,
                v[:, :, :split] if split else None,
                self.scale,
            )[0]
            out[rows] = o.transpose(0, 1)
        return self.wo(out.view(t, h * self.v_dim))

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [n, 1, r + p] -> per-head keys [n, H, n + p] and values [n, H, v]."""
        n, r = latent.shape[0], self.kv_lora_rank
        kv = self.wkv_b(latent[:, 0, :r]).view(n, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k_pe = latent[:, :, r:].expand(n, self.num_heads, self.rope_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v


class AbsorbedAttention(nn.Module):
    """Decode rows of MLA in the absorbed form: B_d single-token queries over their cached
    latents -> [B_d, H, v]. W_UK and W_UV are views of the row-major kv_b_proj weight
    [H * (n + v), r] the caller passes (a backend's replacement holds them prepacked)."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int, scale: float):
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = num_heads, nope_dim, v_dim
        self.kv_lora_rank, self.scale = kv_lora_rank, scale

    def forward(self, q_nope, q_pe, cache, meta: AttentionMetadata, wkv_b: torch.Tensor):
        w = wkv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, n, r], [H, v, r]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        q_abs = torch.cat((q_lat, q_pe), dim=-1)  # [B_d, H, r + p]
        o = latent_attention(q_abs, cache, meta, self.scale, self.kv_lora_rank)
        return torch.einsum("bhr,hvr->bhv", o, w_uv)


def latent_attention(q_abs, cache, meta: AttentionMetadata, scale: float, r: int) -> torch.Tensor:
    """Absorbed queries q_abs [B_d, H, r + p] over their gathered latents -> [B_d, H, r]."""
    keys = gather_slots(cache, meta.decode_slots, q_abs.dtype)[:, :, 0]  # [B_d, L, r + p]
    # One kv head shared by all H query heads: two bmm with the heads as rows, instead of
    # SDPA, whose CPU path would copy the keys H times (enable_gqa) every step.
    scores = torch.bmm(q_abs, keys.transpose(1, 2)).float() * scale  # [B_d, H, L]
    if meta.decode_mask is not None:
        scores = scores.masked_fill(~meta.decode_mask.view(scores.shape[0], 1, -1), float("-inf"))
    return torch.bmm(scores.softmax(dim=-1).to(keys.dtype), keys[..., :r])  # [B_d, H, r]


# DeepSeek's checkpoint names for MLA (models/args.py WeightRule)
MLA_WEIGHTS = rules(
    (r"self_attn\.q_proj\.weight", "attn.wq.weight", None),
    (r"self_attn\.q_a_proj\.(weight|bias)", "attn.wq_a.{0}", None),
    (r"self_attn\.q_a_layernorm\.weight", "attn.q_a_norm.weight", None),
    (r"self_attn\.q_b_proj\.weight", "attn.wq_b.weight", None),
    (r"self_attn\.kv_a_proj_with_mqa\.(weight|bias)", "attn.wkv_a.{0}", None),
    (r"self_attn\.kv_a_layernorm\.weight", "attn.kv_a_norm.weight", None),
    (r"self_attn\.kv_b_proj\.weight", "attn.wkv_b.weight", None),
    (r"self_attn\.o_proj\.(weight|bias)", "attn.wo.{0}", None),
)
