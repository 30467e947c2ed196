"""MiniMax-M2's own pieces (inference/models/minimax_m2.py): its routing against the reference's
router, q/k norms over all heads against the reference's attention, the multi-token-prediction
modules a checkpoint carries, and the variants we refuse at load. Its parity with transformers
runs in test_parity.py, test_arch_variants.py and the kernel and quantization tests, as every
family's."""

from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxM2Config
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

from inference.models.args import ModelArgs, common_fields
from inference.models.minimax_m2 import MiniMaxM2Layer, fields
from tests.inference.family_checks import (
    check_routing_against_reference,
    check_variant_refused,
)
from tests.inference.mtp_checkpoints import check_mtp_layers_load_and_are_not_run


def config(**overrides) -> MiniMaxM2Config:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 32,
        "num_experts_per_tok": 8,
        "intermediate_size": 8,
        "architectures": ["MiniMaxM2ForCausalLM"],
    }
    return MiniMaxM2Config(**(base | overrides))


def test_routing_chooses_and_weighs_as_the_reference_router():
    """Top-k of 32 on the sigmoid scores plus the correction bias, weights from the unbiased
    scores renormalised, no scaling: the same experts and weights as transformers'
    MiniMaxM2TopKRouter, over tokens whose bias moves the choice."""
    cfg = config()
    args = ModelArgs(**(common_fields(cfg) | fields(cfg)))
    ours, ref = MiniMaxM2Layer.routed_experts(args, 0), MiniMaxM2TopKRouter(cfg)
    weights = check_routing_against_reference(ours, ref, experts=32, top_k=8)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))  # renormalised, unscaled


def test_qk_norms_span_all_heads_and_a_part_of_each_head_rotates():
    """The config read as MiniMax-M2 is built: q/k RMSNorm over the whole projection (weights
    of num_heads * head_dim), rotary_dim of each head rotating."""
    cfg = config()
    args = ModelArgs(**(common_fields(cfg) | fields(cfg)))
    attn = MiniMaxM2Layer(args, 0, 0).attn
    assert attn.q_norm.weight.shape == (2 * 16,) and attn.k_norm.weight.shape == (1 * 16,)
    assert (args.rotary_dim, args.rope_dim, attn.rotary_dim) == (8, 8, 8)


def test_the_mtp_modules_of_a_checkpoint_load_and_are_not_run(model_dirs, tmp_path):
    check_mtp_layers_load_and_are_not_run(model_dirs("minimax_m2"), tmp_path, count=3)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"use_routing_bias": False}, "use_routing_bias"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
        ({"attn_type_list": [0, 1]}, "attn_type_list"),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e6,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 512,
                }
            },
            "rope_type",
        ),
    ],
)
def test_a_variant_we_do_not_serve_is_refused_at_load_naming_its_field(
    model_dirs, tmp_path, change, field
):
    check_variant_refused(model_dirs("minimax_m2"), tmp_path / "variant", change, field)
