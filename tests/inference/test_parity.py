"""Our engine against transformers' own implementation, token for token (float32), and in
bf16 as close to transformers' float32 logits as transformers' own bf16 model is. On
MOESERVE_TEST_DEVICE (parity_checks.DEVICE): bench/gpu_check.sh runs them on CUDA."""

from __future__ import annotations

import pytest

from inference import LLMEngine
from tests.inference.parity_checks import (
    DEVICE,
    GREEDY_32,
    bf16_logits_error,
    check_continuous_batch_with_chunked_prefill_and_preemption,
    check_greedy_alone_matches_generate,
    check_logits_match,
    hf_greedy,
    hf_model,
    prompts,
)

ARCHS = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match(model_dirs, arch):
    check_logits_match(model_dirs(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_alone_matches_generate(model_dirs, arch):
    check_greedy_alone_matches_generate(model_dirs(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_continuous_batch_with_chunked_prefill_and_preemption(model_dirs, arch):
    check_continuous_batch_with_chunked_prefill_and_preemption(model_dirs(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_give_identical_outputs(model_dirs, arch):
    path = model_dirs(arch)
    engine = LLMEngine.from_pretrained(path, device=DEVICE, dtype="float32", kv_cache_tokens=1024)
    shared = prompts(engine.args.vocab_size, [40])[0]
    batch = [shared + [5, 6, 7], shared + [9]]
    first = engine.generate(batch, GREEDY_32)
    second = engine.generate(batch, GREEDY_32)
    assert all(o.num_cached_tokens == 0 for o in first[:1])
    assert all(o.num_cached_tokens >= 32 for o in second)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert second[0].token_ids == hf_greedy(hf_model(path, DEVICE), batch[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_are_as_close_to_float32_as_transformers_bf16(model_dirs, arch):
    ours, theirs = bf16_logits_error(model_dirs(arch))
    assert ours <= 1.25 * theirs, (ours, theirs)
