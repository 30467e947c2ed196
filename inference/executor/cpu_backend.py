"""Installs our CPU kernels in a loaded bf16 model from outside: its plain (or 8-bit) modules are
replaced by kernels/modules.py's with their weights prepacked, and where the fused kernel
covers every layer (kernels/csrc/layer.c), a decode step runs the whole model in one call
(FusedDecodeStep). The layer specs the fused kernel reads are taken from the model's modules
here, as gpt-fast's tp.py walks a plain model; a layer of another shape keeps the composed
modules."""

from __future__ import annotations

import torch
from torch import nn

from inference.executor.module_swap import swap_modules
from inference.executor.quantize import QuantEmbedding, QuantExperts, QuantLinear
from inference.executor.sampler import top_tokens
from inference.kernels import cpu
from inference.kernels.modules import (
    CpuAbsorbedAttention,
    CpuExperts,
    CpuLinear,
    CpuPagedAttention,
    CpuQuantEmbedding,
    CpuRMSNorm,
)
from inference.models.attention import AttentionMetadata, PagedAttention
from inference.models.decoder import Attention, Decoder, DecoderLayer
from inference.models.layers import Linear, RMSNorm
from inference.models.mla import AbsorbedAttention, MLAttention
from inference.models.moe import DenseMLP, Experts, MoE, NoAuxMoE, Router, SharedExpertMoE
from inference.quantization.qweight import FOUR_BIT, QWeight


def _replacement(name: str, module: nn.Module, parent: nn.Module) -> nn.Module | None:
    kind = type(module)
    if kind is QuantExperts and module.w13.fmt in FOUR_BIT:
        # (an act-order down projection is gathered there: the loader folds it into gate/up
        # where it can, loader._fold_down_orders)
        if not cpu.int4_moe_fits(module.w13, module.w13.in_features) or module.w2.perm is not None:
            return None  # torch's path, one expert at a time
        return CpuExperts(module)
    if kind is QuantLinear and module.weight.fmt in FOUR_BIT and cpu.INT4 is None:
        return None  # no int4 linear kernel on this CPU: torch's path
    if kind in (Linear, QuantLinear) or (kind is Router and not module.fp32):
        return CpuLinear(module.weight, module.bias)
    if kind in (Experts, QuantExperts):
        return CpuExperts(module)
    if kind is RMSNorm:
        norm = CpuRMSNorm(module.weight.shape[0], module.eps)
        norm.weight = module.weight
        return norm
    if kind is PagedAttention:
        return CpuPagedAttention(module)
    if kind is AbsorbedAttention and isinstance(parent, MLAttention):
        return CpuAbsorbedAttention(module, parent.wkv_b.weight)  # read before it is packed
    if kind is QuantEmbedding:
        return CpuQuantEmbedding(module)
    return None


class FusedDecodeStep:
    """A decode step of every layer in one kernel call, with the model's own signature; steps
    with prefill chunks (or without block tables) run the composed model."""

    def __init__(self, model: Decoder, step: cpu.DecodeStep) -> None:
        self.model, self.step = model, step

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.block_tables is None or meta.prefills:
            return self.model(input_ids, positions, meta, kv_caches)
        rows = input_ids if self.step.embeds else self.model.embed(input_ids)
        return cpu.decode_step(
            self.step,
            rows,
            positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.context_lens,
            meta.block_size,
            kv_caches,
        )


def install(model: nn.Module) -> FusedDecodeStep | None:
    """Replaces the model's modules by the kernels' (weights packed once, parents' needs read
    first: MLA derives its absorbed projections from the row-major kv_b_proj), and returns
    the one-call decode step where the fused kernel covers every layer."""
    swap_modules(model, _replacement)
    if not isinstance(model, Decoder) or not _int4_fits_the_fused_step(model):
        return None
    specs = [layer_spec(layer) for layer in model.layers]
    if not all(specs):
        return None
    embed = model.embed.weight if type(model.embed) is nn.Embedding else None  # int8: no
    rope, norm = model.rope, model.norm
    step = cpu.DecodeStep(specs, embed, rope.cos, rope.sin, norm.weight, norm.eps)
    return FusedDecodeStep(model, step)


def _int4_fits_the_fused_step(model: nn.Module) -> bool:
    """The fused step's products (the main library's, through ms_set_int4) take 4-bit weights
    (int4, rotated or not, mxfp4) on the kernels (none left on torch's path), whose inputs
    are whole octets."""
    int4 = [
        w
        for m in model.modules()
        for w in (getattr(m, n, None) for n in ("weight", "w13", "w2"))
        if isinstance(w, QWeight) and w.fmt in FOUR_BIT
    ]
    return all(w.packed and w.in_features % 8 == 0 for w in int4)


_MAX_GROUPS = 64  # noaux_tc expert groups the fused router holds (csrc/layer.c)


def _float32_routing_fits(moe: MoE) -> bool:
    """The fused router's limits: at most _MAX_GROUPS groups, and (softmax) enough experts in
    the kept groups for the top-k (the composed path would pick masked zeros)."""
    per_group = moe.num_experts // moe.num_groups
    return moe.num_groups <= _MAX_GROUPS and moe.top_k <= moe.topk_group * per_group


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_spec(layer: nn.Module) -> cpu.LayerSpec | None:
    """A decoder layer as the fused decode step reads it, once its modules are the kernels';
    None for layers it does not cover (another layer shape, routing past the fused router's
    limits)."""
    if not isinstance(layer, DecoderLayer):
        return None
    attn, mlp = layer.attn, layer.mlp
    moe, shared = (mlp.moe, mlp.shared) if isinstance(mlp, SharedExpertMoE) else (mlp, None)
    if type(attn) is MLAttention:
        spec = _mla_spec(layer, attn)
    elif type(attn) is Attention and isinstance(attn.wqkv, CpuLinear):
        spec = _attention_spec(layer, attn) if isinstance(attn.attn, CpuPagedAttention) else None
    else:
        spec = None
    if spec is None:
        return None
    # float32 routing: noaux_tc's (its gate kept float32) or DeepSeek-V2's softmax (fp32 Router)
    noaux = type(moe) is NoAuxMoE
    f32 = noaux or (type(moe) is MoE and type(moe.gate) is Router and moe.gate.fp32)
    if layer.is_moe and (
        type(moe) not in (MoE, NoAuxMoE)
        or not isinstance(moe.experts, CpuExperts)
        or (f32 and not _float32_routing_fits(moe))
        or (not f32 and (moe.num_groups > 1 or not isinstance(moe.gate, CpuLinear)))
    ):
        return None
    if layer.is_moe:
        spec.experts, spec.top_k = moe.num_experts, moe.top_k
        spec.moe_inter = moe.experts.intermediate_size
        spec.norm_topk_prob, spec.routed_scaling = int(moe.norm_topk_prob), moe.scaling
        if f32:  # the float32 gate (and noaux_tc's correction bias), read in place
            if moe.gate.weight.dtype != torch.float32:  # V2's bf16 gate, routed in float32
                moe.gate.register_buffer("weight_f32", moe.gate.weight.data.float(), False)
            spec.router_f32 = _ptr(getattr(moe.gate, "weight_f32", moe.gate.weight.data))
            spec.sigmoid = int(noaux)
            if noaux:
                spec.correction_bias = _ptr(moe.gate.e_score_correction_bias.data)
            spec.groups, spec.topk_group = moe.num_groups, moe.topk_group
        else:
            spec.router, spec.router_bias = cpu.wmat(moe.gate.weight), _ptr(moe.gate.bias)
        spec.w13, spec.w2 = cpu.wmat(moe.experts.w13), cpu.wmat(moe.experts.w2)
        if moe.experts.glu is not None:
            spec.glu = moe.experts.glu
        gate = mlp.shared_gate if shared is not None else None
        spec.shared_gate = cpu.wmat(None if gate is None else gate.weight)
    dense = mlp if isinstance(mlp, DenseMLP) else shared
    if dense is not None:
        spec.mlp_inter = dense.intermediate_size
        spec.mlp_w13, spec.mlp_b13 = cpu.wmat(dense.w13.weight), _ptr(dense.w13.bias)
        spec.mlp_w2, spec.mlp_b2 = cpu.wmat(dense.w2.weight), _ptr(dense.w2.bias)
    return spec


def _attention_spec(layer: DecoderLayer, attn: Attention) -> cpu.LayerSpec:
    return cpu.LayerSpec(
        hidden=layer.input_norm.weight.shape[0],
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        qk_norm={None: 0, True: 1, False: 2}[attn.per_head_norm if attn.q_norm else None],
        eps=layer.input_norm.eps,
        scale=attn.scale,
        clip_qkv=attn.clip_qkv or 0.0,
        input_norm=_ptr(layer.input_norm.weight),
        post_norm=_ptr(layer.post_attn_norm.weight),
        wqkv=cpu.wmat(attn.wqkv.weight),
        qkv_bias=_ptr(attn.wqkv.bias),
        wo=cpu.wmat(attn.wo.weight),
        o_bias=_ptr(attn.wo.bias),
        q_norm=_ptr(attn.q_norm.weight) if attn.q_norm else None,
        k_norm=_ptr(attn.k_norm.weight) if attn.k_norm else None,
        rotary_dim=attn.rotary_dim,
        window=attn.attn.window,
        sinks=_ptr(attn.attn.sinks32),
        key_shift=_ptr(attn.attn.key_shift),
        key_hinv=_ptr(attn.attn.key_hinv),
    )


def _mla_spec(layer: DecoderLayer, attn: MLAttention) -> cpu.LayerSpec | None:
    """An MLA layer (its projections on the kernels, its absorbed attention prepacked)."""
    absorbed = attn.absorbed
    projections = [attn.wq_a, attn.wq_b] if attn.q_lora else [attn.wq]
    if not isinstance(absorbed, CpuAbsorbedAttention) or not all(
        isinstance(m, CpuLinear) for m in (*projections, attn.wkv_a, attn.wo)
    ):
        return None
    return cpu.LayerSpec(
        hidden=layer.input_norm.weight.shape[0],
        heads=attn.num_heads,
        kv_heads=1,
        head_dim=attn.nope_dim + attn.rope_dim,
        eps=layer.input_norm.eps,
        scale=attn.scale,
        input_norm=_ptr(layer.input_norm.weight),
        post_norm=_ptr(layer.post_attn_norm.weight),
        wo=cpu.wmat(attn.wo.weight),
        o_bias=_ptr(attn.wo.bias),
        rotary_dim=attn.rope_dim,
        kv_lora_rank=attn.kv_lora_rank,
        q_lora_rank=attn.q_a_norm.weight.shape[0] if attn.q_lora else 0,
        nope_dim=attn.nope_dim,
        v_dim=attn.v_dim,
        uk_stride=absorbed.w_uk_t[0].numel(),
        uv_stride=absorbed.w_uv[0].numel(),
        latent_eps=attn.kv_a_norm.eps,
        q_a_bias=_ptr(attn.wq_a.bias) if attn.q_lora else None,
        q_a_norm=_ptr(attn.q_a_norm.weight) if attn.q_lora else None,
        kv_a_bias=_ptr(attn.wkv_a.bias),
        kv_a_norm=_ptr(attn.kv_a_norm.weight),
        wq_a=cpu.wmat(attn.wq_a.weight) if attn.q_lora else cpu.wmat(None),
        wq_b=cpu.wmat(attn.wq_b.weight if attn.q_lora else attn.wq.weight),
        wkv_a=cpu.wmat(attn.wkv_a.weight),
        w_uk_t=cpu.wmat(absorbed.w_uk_t),
        w_uv=cpu.wmat(absorbed.w_uv),
    )


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's top token: the kernels' vector pass over bf16 logits (torch's bf16 max() is
    scalar: 3.5 ms over [32, 32000], longer than some decode steps)."""
    if cpu.applies(logits) and logits.dim() == 2:
        return cpu.greedy(logits)
    return top_tokens(logits)
