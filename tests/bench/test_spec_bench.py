"""bench/spec_bench.py runs end to end on the tiny model (a function check, no timing
asserted): both arms decode every workload, greedy outputs agree, drafts are counted."""

from __future__ import annotations

import pytest

from bench.spec_bench import TARGETS, measure


@pytest.mark.slow  # two engines, three workloads, two rounds each
def test_the_bench_runs_both_arms_on_every_workload(tiny_model_dir):
    rows = measure(str(tiny_model_dir), rounds=2, max_tokens=6, dtype="float32")
    assert set(rows) == set(TARGETS)
    for name, row in rows.items():
        assert all(len(v) == 2 and min(v) > 0 for v in row["rounds"].values()), name
        assert row["on_over_off"] > 0 and row["identical_outputs"], name
        assert 0 <= row["accepted_tokens"] <= row["draft_tokens"], name
    assert rows["streams32"]["streams"] == 32 and rows["streams32"]["draft_tokens"] == 0
