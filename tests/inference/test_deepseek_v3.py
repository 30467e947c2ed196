"""DeepSeek-V3's own pieces (inference/models/deepseek_v3.py): noaux_tc routing against the
reference's router, the multi-token-prediction layer a checkpoint carries, and the variants we
refuse. Its parity with transformers runs in test_parity.py, test_arch_variants.py and the
kernel and quantization tests, as every family's."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from inference import ModelLoadError
from inference.models.args import ModelArgs, common_fields
from inference.models.deepseek_v3 import DeepseekV3Layer, fields
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
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=g))
        ref.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.5)
        ours.gate.weight.copy_(ref.weight)
        ours.gate.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        weights, ids = ours.route(x)
        _, ref_weights, ref_ids = ref(x)
        unbiased = torch.sigmoid(x @ ref.weight.T).topk(4, dim=-1).indices
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    )
    # the bias changed the choice for some tokens (else the test would prove little)
    assert not torch.equal(order.values, unbiased.sort(dim=-1).values)


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
