"""bench/kv_events_bench.py runs end to end on the tiny model (a function check, no timing
asserted): both arms decode, the "on" arm's batches reach a subscriber through a real
publisher, none dropped, and the result names what it measured."""

from __future__ import annotations

from bench.kv_events_bench import measure


def test_the_bench_publishes_in_the_on_arm_only_and_reports_a_ratio(tiny_model_dir):
    result = measure(
        str(tiny_model_dir),
        rounds=2,
        batch=4,
        prompt_len=48,
        max_tokens=4,
        kv_cache_tokens=256,
        dtype="float32",
    )
    assert [sorted(r) for r in result["rounds"]] == [["off", "on"], ["off", "on"]]
    assert all(rate > 0 for r in result["rounds"] for rate in r.values())
    assert result["on_over_off"] > 0 and result["cost_fraction"] == 1 - result["on_over_off"]
    assert result["batches_received"] > 0 and result["batches_dropped"] == 0
    assert result["workload"]["rounds"] == 2
