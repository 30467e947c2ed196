"""DeepSeek-V3's own pieces (inference/models/deepseek_v3.py): noaux_tc routing against the
reference's router, the multi-token-prediction layer a checkpoint carries, and the variants we
refuse. Its parity with transformers runs in test_parity.py, test_arch_variants.py and the
kernel and quantization tests, as every family's."""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from inference import ModelLoadError
from inference.models.args import ModelArgs, common_fields
from inference.models.deepseek_v3 import DeepseekV3Layer, fields
from tests.inference.family_checks import check_routing_against_reference
from tests.inference.mtp_checkpoints import check_mtp_layers_load_and_are_not_run


def config(**overrides) -> DeepseekV3Config:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 8,
        "intermediate_size": 16,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    return DeepseekV3Config(**(base | overrides))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_noaux_routing_chooses_and_weighs_as_the_reference_router(norm_topk_prob):
    """Experts chosen on the biased scores within the best groups, weighted by the unbiased
    ones: the same experts and weights as transformers' DeepseekV3TopkRouter, over tokens
    whose bias moves the choice."""
    cfg = config(norm_topk_prob=norm_topk_prob)
    args = ModelArgs(**(common_fields(cfg) | fields(cfg)))
    ours, ref = DeepseekV3Layer.routed_experts(args, 0), DeepseekV3TopkRouter(cfg)
    check_routing_against_reference(ours, ref, experts=16, top_k=4)


def test_the_mtp_layer_of_a_checkpoint_loads_and_is_not_run(model_dirs, tmp_path):
    """A published checkpoint carries layer num_hidden_layers (the next-token-prediction
    module: enorm, hnorm, eh_proj, a decoder layer, shared_head): it loads without error and
    changes nothing the engine computes."""
    check_mtp_layers_load_and_are_not_run(model_dirs("deepseek_v3"), tmp_path)


@pytest.mark.parametrize(
    "override, field",
    [
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
    ],
)
def test_a_variant_we_do_not_serve_is_refused_naming_its_field(override, field):
    cfg = config()
    for key, value in override.items():
        setattr(cfg, key, value)
    with pytest.raises(ModelLoadError, match=field):
        fields(cfg)
