"""vLLM's long_prefill_token_threshold: a prompt takes at most that many tokens of a step, so
a long prompt leaves the rest of each step's budget to decoding streams and to prompts that
arrive while it is being prefilled; the output is the same as with whole-budget chunks."""

from __future__ import annotations

import pytest
import torch

from inference import InvalidParameterError, LLMEngine, SamplingParams
from inference.block_manager import BlockManager
from inference.config import EngineConfig
from inference.scheduler import Scheduler
from inference.sequence import Sequence

BLOCK = 16


def _seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, name, 0, list(range(1, prompt_len + 1)), SamplingParams(), None, None)


def _step(sched: Scheduler) -> dict[str, int]:
    """One step's (sequence -> new tokens), those tokens then counted as computed."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
    return {seq.seq_id: n for seq, n in out.scheduled}


@pytest.mark.parametrize("threshold", [0, 64])
def test_a_long_prompt_leaves_the_rest_of_the_budget_to_a_later_one(threshold):
    sched = Scheduler(
        BlockManager(256, BLOCK, False), 8, 256, long_prefill_token_threshold=threshold
    )
    sched.add(_seq("long", 2000))
    assert _step(sched) == {"long": 64 if threshold else 256}
    sched.add(_seq("short", 40))  # arrives while the long one is being prefilled
    if threshold:
        assert _step(sched) == {"long": 64, "short": 40}  # admitted at once, beside it
    else:
        assert _step(sched) == {"long": 256}  # waits: the long prompt took the whole step
        while "short" not in (step := _step(sched)):
            assert step == {"long": 256}


def test_the_threshold_must_not_be_negative():
    with pytest.raises(InvalidParameterError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_capped_chunks_give_the_same_greedy_output(tiny_model_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 17, 90)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for threshold in (0, 32):
        engine = LLMEngine.from_pretrained(
            tiny_model_dir,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=128,
            long_prefill_token_threshold=threshold,
        )
        outputs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
