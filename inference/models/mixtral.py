"""Mixtral (MixtralForCausalLM): softmax top-k routing over every layer's experts, renormalised;
the shared decoder (decoder.py) as is."""

from __future__ import annotations

from transformers import MixtralConfig

from inference.models.args import Family, rules
from inference.models.decoder import ATTENTION_WEIGHTS, EXPERT_WEIGHTS, NORM_WEIGHTS, Decoder


def fields(cfg) -> dict:
    return {
        "num_experts": cfg.num_local_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": True,
    }


WEIGHTS = (
    NORM_WEIGHTS
    + ATTENTION_WEIGHTS
    + rules(
        (r"block_sparse_moe\.gate\.weight", "{moe}gate.weight", None),
        (r"block_sparse_moe\.experts\.(\d+)\.w1\.weight", "{moe}experts.w13", "gate"),
        (r"block_sparse_moe\.experts\.(\d+)\.w3\.weight", "{moe}experts.w13", "up"),
        (r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", "{moe}experts.w2", None),
    )
    + EXPERT_WEIGHTS
)


def demo_config(p, common: dict) -> MixtralConfig:
    return MixtralConfig(
        **common,
        head_dim=p.head_dim,
        intermediate_size=p.ffn,
        num_local_experts=p.num_experts,
        sliding_window=None,
    )


MIXTRAL = Family("MixtralForCausalLM", fields, WEIGHTS, Decoder, ("mixtral", demo_config))
