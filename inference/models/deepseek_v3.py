"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3, R1, V3.1, Kimi-K2, Moonlight): DeepSeek-V2's
multi-head latent attention (mla.py) and shared experts, the first k layers dense, YaRN with
its mscale, and "noaux_tc" routing: sigmoid scores; experts chosen on the scores plus a learned
correction bias, within the best topk_group of n_group groups (a group scores as the sum of its
two best); weights from the unbiased scores, renormalised, times routed_scaling_factor. The
checkpoint's multi-token-prediction layer drafts for speculative method "mtp" (models/mtp.py);
otherwise it is loaded past."""

from __future__ import annotations

from transformers import DeepseekV3Config

from inference.errors import ModelLoadError
from inference.models.args import Family, refuse_unserved, rules
from inference.models.decoder import (
    DENSE_MLP_WEIGHTS,
    EXPERT_WEIGHTS,
    NORM_WEIGHTS,
    Decoder,
    DecoderLayer,
)
from inference.models.deepseek_v2 import SHARED_EXPERT_WEIGHTS, deepseek_fields, demo_shape
from inference.models.mla import MLA_WEIGHTS
from inference.models.moe import NoAuxMoE


class DeepseekV3Layer(DecoderLayer):
    moe_class = NoAuxMoE


class DeepseekV3(Decoder):
    layer_class = DeepseekV3Layer


def noaux_fields(cfg) -> dict:
    """noaux_tc routing's fields as DeepSeek-V3's and GLM-4.5's configs spell them; a variant we
    do not serve (another topk_method or scoring_func, groups that do not split the experts) is
    refused, naming its field."""
    refuse_unserved(cfg, {"topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    arch = cfg.architectures[0]
    n_group, topk_group = cfg.n_group or 1, cfg.topk_group or 1
    if cfg.n_routed_experts % n_group or cfg.n_routed_experts // n_group < 2:
        raise ModelLoadError(
            f"{arch}: n_group {n_group} must split n_routed_experts "
            f"{cfg.n_routed_experts} into groups of two or more"
        )
    if not 1 <= topk_group <= n_group:
        raise ModelLoadError(f"{arch}: topk_group {topk_group} not in [1, n_group]")
    return {
        "num_experts": cfg.n_routed_experts,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "routed_scaling_factor": float(cfg.routed_scaling_factor),
        "topk_method": "noaux_tc",
        "num_groups": n_group,
        "topk_group": topk_group,
        "router_fp32": True,
        "dense_layers": tuple(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers))),
    }


def fields(cfg) -> dict:
    """The config -> ModelArgs fields; a routing or rope layout we do not serve is refused,
    naming its field."""
    refuse_unserved(cfg, {"rope_interleave": True})
    return deepseek_fields(cfg) | noaux_fields(cfg)


WEIGHTS = (
    NORM_WEIGHTS
    + MLA_WEIGHTS
    + rules((r"mlp\.gate\.e_score_correction_bias", "{moe}gate.e_score_correction_bias", None))
    + SHARED_EXPERT_WEIGHTS
    + EXPERT_WEIGHTS
    + DENSE_MLP_WEIGHTS
)


def demo_config(p, common: dict) -> DeepseekV3Config:
    """V3's layout at the preset's size: a low-rank query, noaux_tc routing (in V3's 8 groups
    choosing 4 where there are 64 experts or more)."""
    groups = {"n_group": 8, "topk_group": 4} if p.num_experts >= 64 else {}
    return DeepseekV3Config(
        **(demo_shape(p, common) | groups),
        q_lora_rank=p.hidden // 2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


DEEPSEEK_V3 = Family(
    "DeepseekV3ForCausalLM",
    fields,
    WEIGHTS,
    DeepseekV3,
    ("deepseek_v3", demo_config),
    mtp_layers=True,
    # V3's many small experts: 8 of 256, a quarter of the hidden width each
    demo_shapes={"small": {"num_experts": 256, "top_k": 8, "ffn": 128}},
)
