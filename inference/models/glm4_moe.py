"""GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5, 4.6, Air): standard attention with q/k/v biases, an
optional RMSNorm per head on q and k, partial rotary (the first half of each head rotates),
DeepSeek-V3's noaux_tc routing (moe.NoAuxMoE) with one ungated shared expert, the first k
layers dense. The checkpoint's multi-token-prediction layer drafts for speculative method "mtp"
(models/mtp.py); otherwise it is loaded past."""

from __future__ import annotations

from transformers import Glm4MoeConfig

from inference.models.args import Family, refuse_unserved, rotary_fields, rules
from inference.models.decoder import (
    ATTENTION_WEIGHTS,
    DENSE_MLP_WEIGHTS,
    EXPERT_WEIGHTS,
    NORM_WEIGHTS,
    Decoder,
    DecoderLayer,
)
from inference.models.deepseek_v2 import SHARED_EXPERT_WEIGHTS
from inference.models.deepseek_v3 import noaux_fields
from inference.models.moe import NoAuxMoE


class Glm4MoeLayer(DecoderLayer):
    moe_class = NoAuxMoE


class Glm4Moe(Decoder):
    layer_class = Glm4MoeLayer


def fields(cfg) -> dict:
    """The config -> ModelArgs fields; a routing or rope variant we do not serve is refused,
    naming its field."""
    refuse_unserved(cfg, {"hidden_act": "silu"})
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (
        noaux_fields(cfg)
        | rotary_fields(cfg, head_dim)
        | {
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "qk_norm": "head" if cfg.use_qk_norm else "",
            "qkv_bias": bool(cfg.attention_bias),  # o_proj has none
            "shared_expert_intermediate_size": (cfg.n_shared_experts or 0)
            * cfg.moe_intermediate_size,
            "shared_expert_gated": False,
            "dense_intermediate_size": cfg.intermediate_size,
        }
    )


WEIGHTS = (
    NORM_WEIGHTS
    + ATTENTION_WEIGHTS
    + rules((r"mlp\.gate\.e_score_correction_bias", "{moe}gate.e_score_correction_bias", None))
    + SHARED_EXPERT_WEIGHTS
    + EXPERT_WEIGHTS
    + DENSE_MLP_WEIGHTS
)


def demo_config(p, common: dict) -> Glm4MoeConfig:
    """GLM-4.5's layout at the preset's size: layer 0 dense, q/k/v biases and q/k norms, half
    of each head rotating, one shared expert, noaux_tc routing scaled by 2.5 (GLM-4.5's)."""
    rope = common["rope_parameters"] | {"partial_rotary_factor": 0.5}
    return Glm4MoeConfig(
        **(common | {"rope_parameters": rope}),
        head_dim=p.head_dim,
        intermediate_size=p.ffn * p.top_k,
        moe_intermediate_size=p.ffn,
        n_routed_experts=p.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=0,  # the demo writes no MTP layer
    )


GLM4_MOE = Family(
    "Glm4MoeForCausalLM",
    fields,
    WEIGHTS,
    Glm4Moe,
    ("glm4_moe", demo_config),
    mtp_layers=True,
    # GLM-4.5-Air's routing: 8 of 128 experts, each about 3/8 of the hidden width
    demo_shapes={"small": {"num_experts": 128, "top_k": 8, "ffn": 192}},
)
