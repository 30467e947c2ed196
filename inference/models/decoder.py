"""The decoder (MoE: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2; dense: Llama) over a
flattened batch of tokens.

Nothing but the model: no sampling, no scheduling. forward(input_ids [T], positions [T],
attention metadata, kv caches) -> hidden states [T, D] and router counts [MoE layers, E]
(shape [0, 0] for a dense model).
Each layer's cache entry is a tuple of paged tensors (ModelArgs.kv_cache_shapes): key and
value for standard attention, one compressed latent for MLA (mla.py).
"""

from __future__ import annotations

import torch
from torch import nn

from inference.config import ModelArgs
from inference.kernels import cpu as cpu_kernels
from inference.models.attention import AttentionMetadata, paged_attention
from inference.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    set_weight,
)
from inference.models.mla import MLAttention
from inference.models.moe import DenseMLP, MoE, SharedExpertMoE
from inference.models.paged_cache import write_kv
from inference.quantization import qweight as quant
from inference.quantization.qweight import QWeight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, g, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
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
        if cpu_kernels.applies(qkv):  # rotated in place, keys and values written in the same pass
            cpu_kernels.rope_and_cache(qkv, cos, sin, h, g, meta.slot_mapping, k_cache, v_cache)
            q, k, v = qkv[:, :h], qkv[:, h : h + g], qkv[:, h + g :]
        else:
            qk = apply_rope(qkv[:, : h + g], cos, sin)  # q and k rotated in one pass
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + g :]
            write_kv(k_cache, meta.slot_mapping, k)
            write_kv(v_cache, meta.slot_mapping, v)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.wo(o.reshape(x.shape[0], h * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, gather_max_tokens: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = MLAttention(args) if args.kv_lora_rank else Attention(args)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = layer not in args.dense_layers
        if not self.is_moe:
            self.mlp = DenseMLP(args.hidden_size, args.dense_intermediate_size, args.mlp_bias)
            return
        moe = MoE(
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
        )
        if args.shared_expert_intermediate_size:
            moe = SharedExpertMoE(
                moe,
                DenseMLP(args.hidden_size, args.shared_expert_intermediate_size),
                args.shared_expert_gated,
            )
        self.mlp = moe

    def layer_spec(self) -> cpu_kernels.LayerSpec | None:
        """This layer for the fused decode step (cpu_kernels.decode_step), once its weights are
        packed; None for layers it does not cover (MLA, group-limited or float32 routing)."""
        attn, mlp = self.attn, self.mlp
        moe, shared = (mlp.moe, mlp.shared) if isinstance(mlp, SharedExpertMoE) else (mlp, None)
        dense = mlp if isinstance(mlp, DenseMLP) else shared
        if isinstance(attn, MLAttention) or not cpu_kernels.is_packed(attn.wqkv.weight):
            return None
        if self.is_moe and (
            moe.router_fp32 or moe.num_groups > 1 or not cpu_kernels.is_packed(moe.w13, 3)
        ):
            return None

        def ptr(t):
            return None if t is None else t.data_ptr()

        wmat = cpu_kernels.wmat
        spec = cpu_kernels.LayerSpec(
            hidden=self.input_norm.weight.shape[0],
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            qk_norm={None: 0, True: 1, False: 2}[attn.per_head_norm if attn.q_norm else None],
            eps=self.input_norm.eps,
            scale=attn.scale,
            clip_qkv=attn.clip_qkv or 0.0,
            input_norm=ptr(self.input_norm.weight),
            post_norm=ptr(self.post_attn_norm.weight),
            wqkv=wmat(attn.wqkv.weight),
            qkv_bias=ptr(attn.wqkv.bias),
            wo=wmat(attn.wo.weight),
            o_bias=ptr(attn.wo.bias),
            q_norm=ptr(attn.q_norm.weight) if attn.q_norm else None,
            k_norm=ptr(attn.k_norm.weight) if attn.k_norm else None,
        )
        if self.is_moe:
            spec.experts, spec.top_k = moe.num_experts, moe.top_k
            spec.moe_inter = moe.intermediate_size
            spec.norm_topk_prob, spec.routed_scaling = int(moe.norm_topk_prob), moe.scaling
            spec.router, spec.w13, spec.w2 = wmat(moe.gate), wmat(moe.w13), wmat(moe.w2)
            spec.shared_gate = wmat(mlp.shared_gate if shared is not None else None)
        if dense is not None:
            spec.mlp_inter = dense.intermediate_size
            spec.mlp_w13, spec.mlp_b13 = wmat(dense.w13), ptr(dense.b13)
            spec.mlp_w2, spec.mlp_b2 = wmat(dense.w2), ptr(dense.b2)
        return spec

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


class MoETransformer(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int, gather_max_tokens: int = 0) -> None:
        super().__init__()
        self.args = args
        self.embed = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, gather_max_tokens) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(args, max_positions)
        self.decode_step: cpu_kernels.DecodeStep | None = (
            None  # pack_for_cpu_kernels(): decode steps in one call
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decode_step is not None and meta.block_tables is not None and not meta.prefills:
            # a decode step on the CPU kernels: every layer in one call
            return cpu_kernels.decode_step(
                self.decode_step,
                input_ids if self.decode_step.embeds else self.embed(input_ids),
                positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                meta.block_size,
                kv_caches,
            )
        x = self.embed(input_ids)
        cos, sin = self.rope.tables(positions, x.dtype)
        counts, residual = [], None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual, c = layer(x, residual, cos, sin, meta, cache)
            if c is not None:
                counts.append(c)
        expert_counts = torch.stack(counts) if counts else x.new_zeros(0, 0, dtype=torch.long)
        return self.norm(x, residual)[0], expert_counts

    def pack_for_cpu_kernels(self) -> None:
        """Prepacks every weight the CPU kernels read (cpu_kernels.pack_weight), once after
        loading (parents first: MLA derives its absorbed projections from the row-major
        kv_b_proj before that is packed), and prepares the one-call decode step when the
        fused kernel covers every layer."""
        for module in self.modules():
            if module is not self and hasattr(module, "pack"):
                module.pack()
        specs = [layer.layer_spec() for layer in self.layers]
        if all(specs):
            self.decode_step = cpu_kernels.DecodeStep(
                specs,
                None if isinstance(self.embed.weight, QWeight) else self.embed.weight,
                self.rope.cos,
                self.rope.sin,
                self.norm.weight,
                self.norm.eps,
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def quantize(
        self,
        fmt: str,
        published: dict[str, QWeight],
        lm_head: bool = True,
        only_published: bool = False,
    ) -> None:
        """8-bit weights (quant.py), once after loading: every attention projection, expert
        and dense MLP, and the lm_head if asked; with int8 the embedding table too (a scale
        per row). Routers and norms stay in the model's dtype, as does MLA's kv_b_proj (the
        absorbed projections are derived from it). `published`: fp8 weights as the
        checkpoint shipped them, used as they are; with only_published, what the checkpoint
        kept in 16 bits stays so."""
        if fmt == "int8":
            self.embed.quantize()
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                skip = name.endswith("attn.wkv_b") or (name == "lm_head" and not lm_head)
                attrs = () if skip else ("weight",)
            elif isinstance(module, MoE | DenseMLP):
                attrs = ("w13", "w2")
            else:
                continue
            for attr in attrs:
                kept = published.get(f"{name}.{attr}") if fmt == "fp8" else None
                if kept is None and only_published:
                    continue
                set_weight(module, attr, kept or quant.quantize(getattr(module, attr).data, fmt))

    def weight_bytes(self) -> int:
        """Bytes of weights held: parameters, 8-bit weights and packed extras."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for module in self.modules():
            for value in module.__dict__.values():
                if isinstance(value, QWeight):
                    total += value.nbytes
                elif isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total
