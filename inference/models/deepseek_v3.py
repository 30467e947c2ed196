"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3, R1, V3.1, Kimi-K2, Moonlight): DeepSeek-V2's
multi-head latent attention (mla.py) and shared experts, the first k layers dense, YaRN with
its mscale, and "noaux_tc" routing: sigmoid scores; experts chosen on the scores plus a learned
correction bias, within the best topk_group of n_group groups (a group scores as the sum of its
two best); weights from the unbiased scores, renormalised, times routed_scaling_factor. The
checkpoint's multi-token-prediction layer loads and is not run."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV3Config

from inference.errors import ModelLoadError
from inference.models.args import Family, rules
from inference.models.decoder import (
    DENSE_MLP_WEIGHTS,
    EXPERT_WEIGHTS,
    NORM_WEIGHTS,
    Decoder,
    DecoderLayer,
)
from inference.models.deepseek_v2 import SHARED_EXPERT_WEIGHTS, deepseek_fields, demo_shape
from inference.models.mla import MLA_WEIGHTS
from inference.models.moe import MoE, Router


class CorrectedRouter(Router):
    """The gate, with the per-expert bias that steers the choice of experts (and not their
    weights): DeepSeek's auxiliary-loss-free load balancing. Both stay float32 in every
    model dtype, as the reference keeps them."""

    keep_in_fp32 = True

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts, fp32=True)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class NoAuxMoE(MoE):
    """MoE's arguments; its gate carries the correction bias and routes in float32."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *args, **kw):
        super().__init__(hidden_size, intermediate_size, num_experts, *args, **kw)
        self.gate = CorrectedRouter(hidden_size, num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> top-A weights [T, A] (float32) and expert ids [T, A]."""
        scores = self.gate(x).sigmoid()  # [T, E], float32
        choice = scores + self.gate.e_score_correction_bias
        t, e = choice.shape
        groups = choice.view(t, self.num_groups, e // self.num_groups)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekV3Layer(DecoderLayer):
    moe_class = NoAuxMoE


class DeepseekV3(Decoder):
    layer_class = DeepseekV3Layer


def fields(cfg) -> dict:
    """The config -> ModelArgs fields; a routing or rope layout we do not serve is refused,
    naming its field."""
    for name, served in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        value = getattr(cfg, name, served)
        if value != served:
            raise ModelLoadError(
                f"DeepseekV3ForCausalLM: {name} {value!r} is not supported ({served})"
            )
    if not getattr(cfg, "rope_interleave", True):
        raise ModelLoadError("DeepseekV3ForCausalLM: rope_interleave false is not supported")
    n_group, topk_group = cfg.n_group or 1, cfg.topk_group or 1
    if cfg.n_routed_experts % n_group or cfg.n_routed_experts // n_group < 2:
        raise ModelLoadError(
            f"DeepseekV3ForCausalLM: n_group {n_group} must split n_routed_experts "
            f"{cfg.n_routed_experts} into groups of two or more"
        )
    if not 1 <= topk_group <= n_group:
        raise ModelLoadError(f"DeepseekV3ForCausalLM: topk_group {topk_group} not in [1, n_group]")
    return deepseek_fields(cfg) | {
        "dense_layers": tuple(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers))),
        "topk_method": "noaux_tc",
        "num_groups": n_group,
        "topk_group": topk_group,
    }


WEIGHTS = (
    NORM_WEIGHTS
    + MLA_WEIGHTS
    + rules((r"mlp\.gate\.e_score_correction_bias", "{moe}gate.e_score_correction_bias", None))
    + SHARED_EXPERT_WEIGHTS
    + EXPERT_WEIGHTS
    + DENSE_MLP_WEIGHTS
)


def demo_config(p, common: dict) -> DeepseekV3Config:
    """V3's layout at the preset's size: a low-rank query, noaux_tc routing."""
    return DeepseekV3Config(
        **demo_shape(p, common),
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
)
