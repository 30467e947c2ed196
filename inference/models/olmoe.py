"""OLMoE (OlmoeForCausalLM): RMSNorm over the whole q and k projections, optional clipping of
q/k/v; the shared decoder (decoder.py)."""

from __future__ import annotations

from transformers import OlmoeConfig

from inference.models.args import Family
from inference.models.decoder import ATTENTION_WEIGHTS, EXPERT_WEIGHTS, NORM_WEIGHTS, Decoder


def fields(cfg) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "qk_norm": "full",
        "clip_qkv": cfg.clip_qkv,
        "qkv_bias": bias,
        "o_bias": bias,
    }


def demo_config(p, common: dict) -> OlmoeConfig:
    assert p.hidden == p.num_heads * p.head_dim, "OLMoE has no head_dim field"
    return OlmoeConfig(
        **common, intermediate_size=p.ffn, num_experts=p.num_experts, norm_topk_prob=False
    )


OLMOE = Family(
    "OlmoeForCausalLM",
    fields,
    NORM_WEIGHTS + ATTENTION_WEIGHTS + EXPERT_WEIGHTS,
    Decoder,
    ("olmoe", demo_config),
)
