"""DeepSeek-V2 and V2-Lite (DeepseekV2ForCausalLM): multi-head latent attention (mla.py),
shared experts added ungated, the first k layers (and, as in DeepSeek's own code, layers off
moe_layer_freq) dense, greedy or group-limited routing in float32, scaled by
routed_scaling_factor."""

from __future__ import annotations

from transformers import DeepseekV2Config

from inference.errors import ModelLoadError
from inference.models.args import Family, rules
from inference.models.decoder import DENSE_MLP_WEIGHTS, EXPERT_WEIGHTS, NORM_WEIGHTS, Decoder
from inference.models.mla import MLA_WEIGHTS


def fields(cfg) -> dict:
    method = cfg.topk_method or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(
            f"DeepseekV2ForCausalLM: topk_method {method!r} is not supported "
            "(greedy, group_limited_greedy)"
        )
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    dense = tuple(
        i for i in range(cfg.num_hidden_layers) if i < cfg.first_k_dense_replace or i % freq
    )
    return deepseek_fields(cfg) | {
        "dense_layers": dense,
        "topk_method": method,
        "num_groups": (cfg.n_group or 1) if method == "group_limited_greedy" else 1,
        "topk_group": cfg.topk_group or 1,
    }


def deepseek_fields(cfg) -> dict:
    """What DeepSeek's MLA families (V2, V3) spell alike: the latent attention's ranks, ungated
    shared experts, routing in float32 scaled by routed_scaling_factor."""
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_kv_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "num_experts": cfg.n_routed_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "qkv_bias": bias,
        "o_bias": bias,
        "shared_expert_intermediate_size": (cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
        "shared_expert_gated": False,
        "dense_intermediate_size": cfg.intermediate_size,
        "routed_scaling_factor": float(cfg.routed_scaling_factor),
        "router_fp32": True,
        "q_lora_rank": cfg.q_lora_rank or 0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
    }


# shared experts as both DeepSeek families name them
SHARED_EXPERT_WEIGHTS = rules(
    (r"mlp\.shared_experts\.gate_proj\.weight", "mlp.shared.w13.weight", "gate"),
    (r"mlp\.shared_experts\.up_proj\.weight", "mlp.shared.w13.weight", "up"),
    (r"mlp\.shared_experts\.down_proj\.weight", "mlp.shared.w2.weight", None),
)
WEIGHTS = NORM_WEIGHTS + MLA_WEIGHTS + EXPERT_WEIGHTS + DENSE_MLP_WEIGHTS + SHARED_EXPERT_WEIGHTS


def demo_shape(p, common: dict) -> dict:
    """The demo configs' layout both DeepSeek families share at the preset's size: layer 0
    dense, MLA with a compressed KV of hidden/2, one shared expert, 2 expert groups choosing 1."""
    return common | {
        "num_key_value_heads": p.num_heads,
        "intermediate_size": p.ffn * p.top_k,
        "moe_intermediate_size": p.ffn,
        "n_routed_experts": p.num_experts,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": p.hidden // 2,
        "qk_nope_head_dim": p.head_dim,
        "qk_rope_head_dim": p.head_dim // 2,
        "v_head_dim": p.head_dim,
        "n_group": 2,
        "topk_group": 1,
    }


def demo_config(p, common: dict) -> DeepseekV2Config:
    """V2-Lite's layout: no q LoRA, group-limited routing."""
    return DeepseekV2Config(
        **demo_shape(p, common),
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
    )


DEEPSEEK_V2 = Family(
    "DeepseekV2ForCausalLM", fields, WEIGHTS, Decoder, ("deepseek_v2", demo_config)
)
