"""The decoder the current families share (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 and
V3, GLM-4.5, MiniMax-M2 and dense Llama; each family's file says how its config and checkpoint
map onto it) over a flattened batch of tokens.

Nothing but the model: no sampling, no scheduling, no backend. forward(input_ids [T],
positions [T], attention metadata, kv caches) -> hidden states [T, D] and router counts
[MoE layers, E] (shape [0, 0] for a dense model).
Each layer's cache entry is a tuple of paged tensors (ModelArgs.kv_cache_shapes): key and
value for standard attention, one compressed latent for MLA (mla.py).
"""

from __future__ import annotations

import torch
from torch import nn

from inference.models.args import ModelArgs, rules
from inference.models.attention import AttentionMetadata, PagedAttention
from inference.models.layers import Linear, RMSNorm, RotaryEmbedding
from inference.models.mla import MLAttention
from inference.models.moe import ClampedSwiGLU, DenseMLP, MoE, SharedExpertMoE
from inference.models.mtp import MultiTokenPredictor


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        h, g, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.rotary_dim = args.rope_dim  # < d: partial rotary (the rope tables' width)
        self.wqkv = Linear(args.hidden_size, (h + 2 * g) * d, bias=args.qkv_bias)  # q, k, v fused
        self.wo = Linear(h * d, args.hidden_size, bias=args.o_bias)
        self.scale = d**-0.5
        # q/k RMSNorm before rope: per head (Qwen3-MoE) or over the whole projection (OLMoE)
        self.per_head_norm = args.qk_norm == "head"
        self.q_norm = (
            RMSNorm(d if self.per_head_norm else h * d, args.rms_norm_eps) if args.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(d if self.per_head_norm else g * d, args.rms_norm_eps) if args.qk_norm else None
        )
        self.clip_qkv = args.clip_qkv
        window = args.sliding_window if layer in args.sliding_layers else 0
        self.attn = PagedAttention(h, g, self.scale, window, args.attention_sinks)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        t, h, g = qkv.shape[0], self.num_heads, self.num_kv_heads
        q, k, v = qkv[:, :h], qkv[:, h : h + g], qkv[:, h + g :]
        if not self.per_head_norm:
            q, k = q.reshape(t, -1), k.reshape(t, -1)
        return torch.cat((self.q_norm(q).view(t, h, -1), self.k_norm(k).view(t, g, -1), v), dim=1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h, g = self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x).view(x.shape[0], h + 2 * g, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        o = self.attn(qkv, cos, sin, meta, k_cache, v_cache)
        return self.wo(o.reshape(x.shape[0], h * self.head_dim))


class DecoderLayer(nn.Module):
    moe_class = MoE  # a family with routing of its own subclasses MoE (taking its arguments)

    def __init__(self, args: ModelArgs, layer: int, gather_max_tokens: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = MLAttention(args) if args.kv_lora_rank else Attention(args, layer)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = layer not in args.dense_layers
        self.mlp = self.feed_forward(args, layer, gather_max_tokens)

    def feed_forward(self, args: ModelArgs, layer: int, gather_max_tokens: int) -> nn.Module:
        """Layer `layer`'s MLP: dense, routed experts, or routed plus shared experts."""
        if layer in args.dense_layers:
            return DenseMLP(args.hidden_size, args.dense_intermediate_size, args.mlp_bias)
        moe = self.routed_experts(args, gather_max_tokens)
        if not args.shared_expert_intermediate_size:
            return moe
        shared = DenseMLP(args.hidden_size, args.shared_expert_intermediate_size)
        return SharedExpertMoE(moe, shared, args.shared_expert_gated)

    @classmethod
    def routed_experts(cls, args: ModelArgs, gather_max_tokens: int) -> MoE:
        """The router and experts of a MoE layer, of the layer's moe_class."""
        return cls.moe_class(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.top_k,
            args.norm_topk_prob,
            gather_max_tokens,
            args.num_groups,
            args.topk_group,
            args.routed_scaling_factor,
            args.router_fp32,
            router_bias=args.router_bias,
            expert_bias=args.expert_bias,
            glu=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit) if args.swiglu_limit else None,
        )

    def forward(self, x, residual, cos, sin, meta, cache: tuple[torch.Tensor, ...]):
        """x: the previous layer's output, residual: the running sum before it (None in the
        first layer); each residual add is fused into the norm after it. Returns this
        layer's output, the new residual and the router counts (None for a dense layer)."""
        if residual is None:
            residual, h = x, self.input_norm(x)
        else:
            h, residual = self.input_norm(x, residual)
        h, residual = self.post_attn_norm(self.attn(h, cos, sin, meta, *cache), residual)
        if self.is_moe:
            out, counts = self.mlp(h)
            return out, residual, counts
        return self.mlp(h), residual, None


class Decoder(nn.Module):
    layer_class = DecoderLayer  # a family whose layers differ subclasses both

    def __init__(self, args: ModelArgs, max_positions: int, gather_max_tokens: int = 0) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(args, i, gather_max_tokens) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(args, max_positions)
        # the checkpoint's MTP layer, run by the "mtp" drafter (spec_decode/mtp.py) only
        self.mtp = (
            MultiTokenPredictor(args, self.layer_class, gather_max_tokens) if args.mtp else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        cos, sin = self.rope.tables(positions, x.dtype)
        counts, residual = [], None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual, c = layer(x, residual, cos, sin, meta, cache)
            if c is not None:
                counts.append(c)
        expert_counts = torch.stack(counts) if counts else x.new_zeros(0, 0, dtype=torch.long)
        return self.norm(x, residual)[0], expert_counts

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


# Checkpoint names of the parts the families share (models/args.py WeightRule), in the
# Hugging Face layout most decoders use ("model.layers.N." stripped).
NORM_WEIGHTS = rules(
    (r"input_layernorm\.weight", "input_norm.weight", None),
    (r"post_attention_layernorm\.weight", "post_attn_norm.weight", None),
)
ATTENTION_WEIGHTS = rules(
    (r"self_attn\.([qkv])_proj\.(weight|bias)", "attn.wqkv.{1}", "{0}"),
    (r"self_attn\.o_proj\.(weight|bias)", "attn.wo.{0}", None),
    (r"self_attn\.([qk])_norm\.weight", "attn.{0}_norm.weight", None),  # Qwen3-MoE, OLMoE
)
DENSE_MLP_WEIGHTS = rules(
    (r"mlp\.gate_proj\.(weight|bias)", "mlp.w13.{0}", "gate"),  # biases: Llama's mlp_bias
    (r"mlp\.up_proj\.(weight|bias)", "mlp.w13.{0}", "up"),
    (r"mlp\.down_proj\.(weight|bias)", "mlp.w2.{0}", None),
)
# routed experts named as Qwen2-MoE names them, and transformers 5's fused stacks
EXPERT_WEIGHTS = rules(
    (r"mlp\.gate\.weight", "{moe}gate.weight", None),
    (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "{moe}experts.w13", "gate"),
    (r"mlp\.experts\.(\d+)\.up_proj\.weight", "{moe}experts.w13", "up"),
    (r"mlp\.experts\.(\d+)\.down_proj\.weight", "{moe}experts.w2", None),
    (r"(?:block_sparse_moe|mlp)\.experts\.gate_up_proj", "{moe}experts.w13", None),
    (r"(?:block_sparse_moe|mlp)\.experts\.down_proj", "{moe}experts.w2", None),
)
