"""Qwen2-MoE (Qwen2MoeForCausalLM: a sigmoid-gated shared expert, q/k/v biases) and Qwen3-MoE
(Qwen3MoeForCausalLM: RMSNorm per head on q and k). Both may have dense layers
(decoder_sparse_step, mlp_only_layers); the shared decoder (decoder.py) runs both."""

from __future__ import annotations

from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from inference.models.args import Family, rules
from inference.models.decoder import (
    ATTENTION_WEIGHTS,
    DENSE_MLP_WEIGHTS,
    EXPERT_WEIGHTS,
    NORM_WEIGHTS,
    Decoder,
)


def _moe_fields(cfg) -> dict:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(cfg, "mlp_only_layers", []) or [])
    dense = tuple(
        i
        for i in range(cfg.num_hidden_layers)
        if i in only_mlp or cfg.num_experts == 0 or (i + 1) % step != 0
    )
    return {
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "dense_layers": dense,
        "dense_intermediate_size": cfg.intermediate_size,
    }


def qwen2_fields(cfg) -> dict:
    return _moe_fields(cfg) | {
        "qkv_bias": bool(getattr(cfg, "qkv_bias", True)),
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }


def qwen3_fields(cfg) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    return _moe_fields(cfg) | {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias}


QWEN3_WEIGHTS = NORM_WEIGHTS + ATTENTION_WEIGHTS + EXPERT_WEIGHTS + DENSE_MLP_WEIGHTS
QWEN2_WEIGHTS = QWEN3_WEIGHTS + rules(
    (r"mlp\.shared_expert\.gate_proj\.weight", "mlp.shared.w13.weight", "gate"),
    (r"mlp\.shared_expert\.up_proj\.weight", "mlp.shared.w13.weight", "up"),
    (r"mlp\.shared_expert\.down_proj\.weight", "mlp.shared.w2.weight", None),
    (r"mlp\.shared_expert_gate\.weight", "mlp.shared_gate.weight", None),
)


def qwen2_demo(p, common: dict) -> Qwen2MoeConfig:
    assert p.hidden == p.num_heads * p.head_dim, "Qwen2-MoE has no head_dim field"
    return Qwen2MoeConfig(
        **common,
        intermediate_size=p.ffn,
        moe_intermediate_size=p.ffn,
        shared_expert_intermediate_size=p.shared_ffn or p.ffn,
        num_experts=p.num_experts,
        norm_topk_prob=False,
        use_sliding_window=False,
    )


def qwen3_demo(p, common: dict) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **common,
        head_dim=p.head_dim,
        intermediate_size=p.ffn,
        moe_intermediate_size=p.ffn,
        num_experts=p.num_experts,
        norm_topk_prob=True,
        use_sliding_window=False,
    )


QWEN2_MOE = Family(
    "Qwen2MoeForCausalLM", qwen2_fields, QWEN2_WEIGHTS, Decoder, ("qwen2_moe", qwen2_demo)
)
QWEN3_MOE = Family(
    "Qwen3MoeForCausalLM", qwen3_fields, QWEN3_WEIGHTS, Decoder, ("qwen3_moe", qwen3_demo)
)
