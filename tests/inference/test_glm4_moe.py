"""GLM-4.5's own pieces (inference/models/glm4_moe.py): its noaux_tc routing against the
reference's router, the multi-token-prediction layer a checkpoint carries, and the variants we
refuse at load. Its parity with transformers (partial rotary, q/k norms, shared experts, the
dense first layer) runs in test_parity.py, test_arch_variants.py and the kernel and
quantization tests, as every family's."""

from __future__ import annotations

import pytest
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from inference.models.args import ModelArgs, common_fields
from inference.models.glm4_moe import Glm4MoeLayer, fields
from tests.inference.family_checks import (
    check_routing_against_reference,
    check_variant_refused,
)
from tests.inference.mtp_checkpoints import check_mtp_layers_load_and_are_not_run


def config(**overrides) -> Glm4MoeConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 8,
        "intermediate_size": 16,
        "routed_scaling_factor": 2.5,
        "architectures": ["Glm4MoeForCausalLM"],
    }
    return Glm4MoeConfig(**(base | overrides))


@pytest.mark.parametrize(
    "n_group, topk_group, norm_topk_prob", [(1, 1, True), (4, 2, True), (4, 2, False)]
)
def test_routing_chooses_and_weighs_as_the_reference_router(n_group, topk_group, norm_topk_prob):
    """The same experts and weights as transformers' Glm4MoeTopkRouter, in one group (GLM-4.5's
    own checkpoints) and in groups, over tokens whose correction bias moves the choice."""
    cfg = config(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    args = ModelArgs(**(common_fields(cfg) | fields(cfg)))
    ours, ref = Glm4MoeLayer.routed_experts(args, 0), Glm4MoeTopkRouter(cfg)
    check_routing_against_reference(ours, ref, experts=16, top_k=4)


def test_the_mtp_layer_of_a_checkpoint_loads_and_is_not_run(model_dirs, tmp_path):
    check_mtp_layers_load_and_are_not_run(model_dirs("glm4_moe"), tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3, "n_group": 2}, "topk_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
            "rope_type",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e6,
                    "partial_rotary_factor": 0.3125,
                }
            },
            "partial_rotary_factor",
        ),
    ],
)
def test_a_variant_we_do_not_serve_is_refused_at_load_naming_its_field(
    model_dirs, tmp_path, change, field
):
    check_variant_refused(model_dirs("glm4_moe"), tmp_path / "variant", change, field)
