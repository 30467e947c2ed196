"""bench/tco.py's arithmetic (nothing timed): $/1M output tokens = price / 3600 / tok/s x 1e6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tco import main, tco_rows

ROOT = Path(__file__).resolve().parents[2]
SPEED = {
    "engines": {
        "int8": {"single_stream": 200.0, "batched": 2000.0},
        "bf16": {"single_stream": 100.0, "batched": 1000.0, "weight_bytes": 1},
    }
}


def test_rows_follow_the_price_and_the_measured_rates():
    rows = tco_rows(SPEED, 3.6)  # $0.001 per second
    assert [r["format"] for r in rows] == ["bf16", "int8"]
    bf16, int8 = rows
    assert bf16["single_stream_usd_per_million"] == pytest.approx(10.0)  # 1e-3 / 100 * 1e6
    assert bf16["batched_usd_per_million"] == pytest.approx(1.0)
    assert int8["single_stream_usd_per_million"] == pytest.approx(5.0)
    assert int8["batched_usd_per_million"] == pytest.approx(0.5)


def test_the_script_prints_the_table_and_writes_json(tmp_path, capsys):
    results = tmp_path / "quant.json"
    results.write_text(json.dumps({"cpu": "test cpu", "date": "2026-12-05", "speed": SPEED}))
    out = tmp_path / "tco.json"
    assert main(["--cost-per-hour", "7.2", "--results", str(results), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "$7.2/hour on test cpu" in table and "| bf16 | 100 | 20.0000 | 1000 | 2.0000 |" in table
    assert [r["format"] for r in json.loads(out.read_text())["rows"]] == ["bf16", "int8"]


def test_the_checked_in_measurements_give_a_row_per_format():
    measured = json.loads((ROOT / "bench/results/quant_bench.json").read_text())
    rows = tco_rows(measured["speed"], 1.0)
    assert {"bf16", "int8"} <= {r["format"] for r in rows}
    assert all(r["batched_usd_per_million"] > 0 for r in rows)
