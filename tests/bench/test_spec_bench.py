"""bench/spec_bench.py runs end to end on the tiny model (a function check, no timing
asserted): both arms decode every workload, greedy outputs agree, drafts are counted."""

from __future__ import annotations

import pytest

from bench.spec_bench import MTP_SPEC, TARGETS, measure
from inference.checkpoints.mtp_layer import write_with_mtp_layer


@pytest.mark.slow  # two engines, three workloads, two rounds each
def test_the_bench_runs_both_arms_on_every_workload(tiny_model_dir):
    rows = measure(str(tiny_model_dir), rounds=2, max_tokens=6, dtype="float32")
    assert set(rows) == set(TARGETS)
    for name, row in rows.items():
        assert all(len(v) == 2 and min(v) > 0 for v in row["rounds"].values()), name
        assert row["on_over_off"] > 0 and row["identical_outputs"], name
        assert 0 <= row["accepted_tokens"] <= row["draft_tokens"], name
    assert rows["streams32"]["streams"] == 32 and rows["streams32"]["draft_tokens"] == 0


@pytest.mark.slow  # two engines, three workloads, two rounds each
def test_the_mtp_rows_run_on_a_deepseek_v3_with_an_mtp_layer(model_dirs, tmp_path):
    """--method mtp: the MTP layer that drafts the target's next token gets its drafts
    accepted on one stream; 32 streams do not speculate."""
    path = write_with_mtp_layer(model_dirs("deepseek_v3"), tmp_path / "m", self_predicting=True)
    rows = measure(str(path), rounds=2, max_tokens=6, dtype="float32", spec=MTP_SPEC)
    for name, row in rows.items():
        assert row["identical_outputs"], name
    assert rows["repeat"]["accepted_tokens"] > 0
    assert rows["streams32"]["draft_tokens"] == 0
