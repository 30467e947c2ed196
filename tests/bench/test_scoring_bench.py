"""bench/scoring_bench.py runs end to end against a served tiny model (a function check, no
timing asserted): every arm of every round answered, in alternating order, each prompt
scored whole by the scoring arms, the in-process parts each timed every round, and the result
names its ratios and workload; the arithmetic floor it reports, counted by hand on the tiny
model."""

from __future__ import annotations

import pytest

from bench.scoring_bench import ARMS, arithmetic_floor, measure
from bench.scoring_parts import PARTS


@pytest.mark.slow
def test_the_bench_times_every_arm_each_round_and_reports_ratios(tiny_model_dir):
    result = measure(
        tiny_model_dir, rounds=2, batch=2, prompt_len=48, server_args=("--dtype", "float32")
    )
    assert set(result["seconds"]) == set(ARMS)
    assert all(len(t) == 2 and min(t) > 0 for t in result["seconds"].values())
    medians = result["median_seconds"]
    assert result["echo_over_prefill"] == medians["echo"] / medians["prefill"]
    assert result["prompt_logprobs_over_prefill"] > 0
    assert result["workload"]["rounds"] == 2 and result["workload"]["prompt_len"] == 48
    assert result["arithmetic_floor"] == arithmetic_floor(tiny_model_dir, 48)
    parts = result["parts"]
    assert set(parts["seconds"]) == set(PARTS)
    assert all(len(t) == 2 and min(t) > 0 for t in parts["seconds"].values())
    median = parts["median_seconds"]
    assert parts["floor"] == (median["prefill"] + median["lm_head"]) / median["prefill"]


def test_the_arithmetic_floor_counts_a_tokens_multiply_adds_by_hand(tiny_model_dir):
    """The tiny demo (2 layers, hidden 64, 4 heads x 16, 2 KV heads, 4 experts top-2 of width
    128, vocab 1024) at 64 tokens: its body and lm_head per token as counted by hand."""
    layer = (
        64 * 64
        + 2 * 64 * 32
        + 64 * 64  # q, k, v, o
        + 64 * 4  # router
        + 2 * 3 * 64 * 128  # two experts' gate, up, down
        + 2 * 64  # the two norms
    )
    scores = 2 * 4 * (16 + 16) * (64 + 1) / 2  # QK and AV at the mean context, both layers
    body = 2 * layer + 64 + 64 + scores  # + the final norm and one embedding row
    floor = arithmetic_floor(tiny_model_dir, 64)
    assert floor["body_macs_per_token"] == body
    assert floor["lm_head_macs_per_token"] == 1024 * 64
    lm = 1024 * 64
    assert floor["floor_ratio"] == pytest.approx((64 * body + 64 * lm) / (64 * body + lm))
    assert 1 < floor["floor_ratio"] < 1 + lm / body
