"""DeepSeek-V2 specifics: the paged cache holds the compressed latent (not expanded keys and
values), and the routing methods (greedy, group-limited, routed scaling factor)."""

from __future__ import annotations

import pytest
import torch

from inference import LLMEngine
from inference.errors import ModelLoadError
from inference.executor.kv_cache import kv_bytes_per_token
from inference.models.moe import select_experts
from inference.models.registry import SUPPORTED_ARCHITECTURES, model_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_is_latent_plus_rope_key(model_dirs, dtype):
    engine = LLMEngine.from_pretrained(
        model_dirs("deepseek_v2"), device="cpu", dtype="float32", kv_cache_tokens=256
    )
    cfg, args = engine.args.hf_config, engine.args
    elem = torch.empty((), dtype=dtype).element_size()
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * elem
    assert kv_bytes_per_token(args, dtype) == latent
    expanded = (
        cfg.num_attention_heads
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        * cfg.num_hidden_layers
        * elem
    )
    assert latent * 3 < expanded  # tiny config; real V2-Lite: 576 vs 8192 values per layer


def test_allocated_cache_is_one_latent_tensor_per_layer(model_dirs):
    engine = LLMEngine.from_pretrained(
        model_dirs("deepseek_v2"), device="cpu", dtype="float32", kv_cache_tokens=256
    )
    cfg = engine.args.hf_config
    assert len(engine.executor.kv_caches) == cfg.num_hidden_layers
    for layer in engine.executor.kv_caches:
        [latent] = layer
        assert latent.shape == (256, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    total = sum(t.numel() * t.element_size() for layer in engine.executor.kv_caches for t in layer)
    assert total == 256 * kv_bytes_per_token(engine.args, torch.float32)


def test_standard_attention_cache_keeps_key_and_value(model_dirs):
    engine = LLMEngine.from_pretrained(
        model_dirs("qwen3_moe"), device="cpu", dtype="float32", kv_cache_tokens=64
    )
    a = engine.args
    assert (
        kv_bytes_per_token(a, torch.float32) == 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4
    )
    assert all(len(layer) == 2 for layer in engine.executor.kv_caches)


def test_group_limited_routing_picks_only_from_top_groups():
    # 8 experts in 4 groups of 2; group scores (max within group): 0.30, 0.25, 0.04, 0.22.
    # Greedy top-3 takes experts 0, 2 and 6; with topk_group=2 only groups 0 and 1 (experts
    # 0-3) may be chosen, so expert 6 (0.22) loses to expert 1 (0.03).
    probs = torch.tensor([[0.30, 0.03, 0.25, 0.01, 0.04, 0.01, 0.22, 0.14]])
    w, ids = select_experts(probs, top_k=3, norm_topk_prob=False)
    assert sorted(ids[0].tolist()) == [0, 2, 6]
    w, ids = select_experts(probs, top_k=3, norm_topk_prob=False, num_groups=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [0, 1, 2]
    torch.testing.assert_close(w[0], torch.tensor([0.30, 0.25, 0.03]))  # weights are the raw scores
    w, ids = select_experts(probs, top_k=2, norm_topk_prob=False, num_groups=4, topk_group=1)
    assert ids[0].tolist() == [0, 1]


def test_routed_scaling_factor_and_renormalisation():
    probs = torch.tensor([[0.5, 0.2, 0.19, 0.11], [0.1, 0.6, 0.1, 0.2]])
    w, ids = select_experts(probs, top_k=2, norm_topk_prob=False, scaling=16.0)
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(w, torch.tensor([[8.0, 3.2], [9.6, 3.2]]))
    w, _ = select_experts(probs, top_k=2, norm_topk_prob=True, scaling=2.0)
    torch.testing.assert_close(w, torch.tensor([[2 * 5 / 7, 2 * 2 / 7], [2 * 0.75, 2 * 0.25]]))


def test_architectures_and_unknown_ones(model_dirs):
    assert set(SUPPORTED_ARCHITECTURES) == {
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "GptOssForCausalLM",
        "Glm4MoeForCausalLM",
        "MiniMaxM2ForCausalLM",
        "LlamaForCausalLM",
    }
    cfg = LLMEngine.from_pretrained(
        model_dirs("deepseek_v2"), device="cpu", dtype="float32", kv_cache_tokens=64
    ).args.hf_config
    args = model_args(cfg)
    assert (
        args.dense_layers == (0,)
        and args.shared_expert_intermediate_size == cfg.moe_intermediate_size
    )
    assert (args.num_groups, args.topk_group) == (2, 1) and not args.shared_expert_gated
    cfg.topk_method = "noaux_tc"
    with pytest.raises(ModelLoadError, match="noaux_tc"):
        model_args(cfg)
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        model_args(cfg)
