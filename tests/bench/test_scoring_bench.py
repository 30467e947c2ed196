"""bench/scoring_bench.py runs end to end against a served tiny model (a function check, no
timing asserted): every arm of every round answered, in alternating order, each prompt
scored whole by the scoring arms, and the result names its ratios and workload."""

from __future__ import annotations

import pytest

from bench.scoring_bench import ARMS, measure


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
