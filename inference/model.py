"""The MoE decoder (Mixtral, Qwen2-MoE) over a flattened batch of tokens.

Nothing but the model: no sampling, no scheduling. forward(input_ids [T], positions [T],
attention metadata, kv caches) -> hidden states [T, D] and router counts [layers, E].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.attention import AttentionMetadata, paged_attention, write_kv
from inference.config import ModelArgs
from inference.moe import DenseMLP, MoE, SharedExpertMoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from transformers' own rope initialisers so scaled
    variants (linear, dynamic-free yarn, llama3) match the reference."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = args.hf_config
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim)
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; rotate-half convention of the Hugging Face checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        qkv_out = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)  # q, k, v fused
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h, g = self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x).view(x.shape[0], h + 2 * g, self.head_dim)
        qk = apply_rope(qkv[:, : h + g], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + g:]
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.wo(o.reshape(x.shape[0], h * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, gather_max_tokens: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = layer not in args.dense_layers
        if not self.is_moe:
            self.mlp = DenseMLP(args.hidden_size, args.dense_intermediate_size)
            return
        moe = MoE(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.top_k,
                  args.norm_topk_prob, gather_max_tokens)
        if args.shared_expert_intermediate_size:
            moe = SharedExpertMoE(moe, DenseMLP(args.hidden_size, args.shared_expert_intermediate_size))
        self.mlp = moe

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.attn(self.input_norm(x), cos, sin, meta, k_cache, v_cache)
        h = self.post_attn_norm(x)
        if self.is_moe:
            out, counts = self.mlp(h)
            return x + out, counts
        return x + self.mlp(h), None


class MoETransformer(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, gather_max_tokens: int = 0) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, gather_max_tokens) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(args, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        cos, sin = self.rope.tables(positions, x.dtype)
        counts = []
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, c = layer(x, cos, sin, meta, k_cache, v_cache)
            if c is not None:
                counts.append(c)
        expert_counts = torch.stack(counts) if counts else x.new_zeros(0, 0, dtype=torch.long)
        return self.norm(x), expert_counts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
