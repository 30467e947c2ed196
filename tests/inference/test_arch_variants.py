"""Configuration options the tiny demo checkpoints leave off, against transformers (float32):
DeepSeek-V2 with a low-rank query, YaRN rope scaling (mscale != mscale_all_dim, so both the
cos/sin attention factor and the softmax mscale matter), greedy routing, a routed scaling
factor and attention biases; OLMoE with clip_qkv; Qwen3-MoE with attention biases and dense
(mlp_only) layers; gpt-oss with every layer sliding over a short window, plain rope and no
attention biases; GLM-4.5 and MiniMax-M2 with partial rotary under YaRN, GLM's routing in
groups. Norm weights and biases (noaux_tc's correction bias too) are randomised so they are
really exercised.
On MOESERVE_TEST_DEVICE (parity_checks.DEVICE)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference import LLMEngine
from inference.checkpoints.demo_model import ARCHS, PRESETS
from inference.models.attention import AttentionMetadata, PrefillChunk
from tests.inference.parity_checks import DEVICE, hf_model

# DeepSeek's YaRN (factor 4 over 512 positions, mscale on every dim)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
VARIANTS = {
    "deepseek_v2_yarn_qlora": (
        "deepseek_v2",
        {
            "q_lora_rank": 24,
            "topk_method": "greedy",
            "n_group": None,
            "topk_group": None,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
            "max_position_embeddings": 2048,
            "rope_parameters": YARN,
        },
    ),
    # noaux_tc routing (its correction bias drawn at random below, as every bias), YaRN, a
    # low-rank query, 4 groups of 2 experts choosing 2
    "deepseek_v3_yarn_groups": (
        "deepseek_v3",
        {
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": YARN,
        },
    ),
    # noaux_tc routing in 4 groups of 2 choosing 2, unnormalised, no q/k norms, YaRN over
    # half of each head (partial rotary under a scaled rope)
    "glm4_moe_yarn_groups_no_qk_norm": (
        "glm4_moe",
        {
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": False,
            "use_qk_norm": False,
            "max_position_embeddings": 2048,
            "rope_parameters": YARN | {"partial_rotary_factor": 0.5},
        },
    ),
    # a quarter of each head rotating, under YaRN
    "minimax_m2_yarn_quarter_rotary": (
        "minimax_m2",
        {
            "rotary_dim": 4,
            "max_position_embeddings": 2048,
            "rope_parameters": YARN | {"partial_rotary_factor": 0.25},
        },
    ),
    # every layer sliding over 4 positions (the continued chunk and the decode steps slide
    # it), plain rope, no attention biases, a clamp low enough to bind often
    "gpt_oss_window_4_default_rope": (
        "gpt_oss",
        {
            "layer_types": ["sliding_attention", "sliding_attention"],
            "sliding_window": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": False,
            "swiglu_limit": 2.0,
        },
    ),
    "olmoe_clip_qkv": ("olmoe", {"clip_qkv": 0.5}),
    "qwen3_moe_bias_dense": ("qwen3_moe", {"attention_bias": True, "mlp_only_layers": [0]}),
}


@pytest.fixture(scope="module")
def variant_dir(model_dirs, tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            arch, overrides = VARIANTS[name]
            out = tmp_path_factory.mktemp(name)
            shutil.copytree(model_dirs(arch), out, dirs_exist_ok=True)  # tokenizer files
            config = ARCHS[arch](
                PRESETS["tiny"], {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
            )
            for key, value in overrides.items():
                setattr(config, key, value)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                with torch.no_grad():
                    for pname, p in model.named_parameters():
                        if "norm" in pname or pname.endswith(("bias", "sinks")):
                            p.add_(torch.randn_like(p) * 0.1)
                    for pname, b in model.named_buffers():  # noaux_tc's correction bias
                        if pname.endswith("e_score_correction_bias"):
                            b.add_(torch.rand_like(b) * 0.5)  # large enough to move choices
                    lm_head = model.get_output_embeddings().weight
                    torch.nn.init.normal_(lm_head, std=2.0 / config.hidden_size**0.5)
            model.save_pretrained(out)
            made[name] = out
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_logits_match(variant_dir, name):
    """A fresh prefill, a prefill chunk continuing from the cache, then decode steps."""
    path = variant_dir(name)
    engine = LLMEngine.from_pretrained(path, device=DEVICE, dtype="float32", kv_cache_tokens=256)
    ref = hf_model(path, DEVICE)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, engine.args.vocab_size, (24,), generator=g).tolist()
    model, caches = engine.executor.model, engine.executor.kv_caches

    def at(*values):
        return torch.tensor(values, device=DEVICE)

    def span(start, end):
        return torch.arange(start, end, device=DEVICE)

    def check(hidden, upto):
        expected = ref(at(tokens[:upto])).logits[0, -hidden.shape[0] :]
        torch.testing.assert_close(model.logits(hidden), expected, atol=1e-4, rtol=1e-4)

    with torch.inference_mode():
        meta = AttentionMetadata(span(0, 12), 0, None, None, [PrefillChunk(0, 12, 0, None)])
        check(model(at(*tokens[:12]), span(0, 12), meta, caches)[0], 12)
        chunk = PrefillChunk(0, 8, 12, span(0, 20))  # rows 12..19 over a cached context of 12
        meta = AttentionMetadata(span(12, 20), 0, None, None, [chunk])
        check(model(at(*tokens[12:20]), span(12, 20), meta, caches)[0], 20)
        for pos in range(20, 24):
            meta = AttentionMetadata(
                at(pos),
                1,
                span(0, pos + 1)[None],
                torch.ones(1, 1, 1, pos + 1, dtype=torch.bool, device=DEVICE),
                [],
            )
            check(model(at(tokens[pos]), at(pos), meta, caches)[0], pos + 1)
