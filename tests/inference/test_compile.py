"""The compiled decode path (EngineConfig.compile / `serve --compile`): same tokens as
transformers, and no recompilation once the engine has warmed up."""

from __future__ import annotations

import pytest
import torch._dynamo.utils

from inference import LLMEngine, SamplingParams
from tests.inference.parity_checks import (
    check_continuous_batch_with_chunked_prefill_and_preemption,
    check_greedy_alone_matches_generate,
    prompts,
)

pytestmark = pytest.mark.slow  # each engine compiles its decode graphs (10-30 s on 2 cores)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_compiled_greedy_matches_generate(model_dirs, arch):
    check_greedy_alone_matches_generate(model_dirs(arch), compile=True)


def test_compiled_continuous_batch_with_chunked_prefill_and_preemption(model_dirs):
    check_continuous_batch_with_chunked_prefill_and_preemption(model_dirs("mixtral"), compile=True)


def test_no_recompilation_after_warm_up(model_dirs):
    engine = LLMEngine.from_pretrained(
        model_dirs("mixtral"), device="cpu", dtype="float32", compile=True
    )
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2  # warm-up compiled the one-sequence and the batch graphs
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # batch sizes 1..6, contexts crossing block boundaries, sequences finishing at different steps
    for batch in ([3], [40, 17], [5, 70, 33, 12, 9, 64]):
        outs = engine.generate(prompts(engine.args.vocab_size, batch), params)
        assert all(len(o.token_ids) == 20 for o in outs)
    engine.generate(
        prompts(engine.args.vocab_size, [8, 30]),
        SamplingParams(max_tokens=5, temperature=0.9, seed=1),
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
