"""bench/startup_bench.py's helpers (nothing timed): the median start, the table, and the
page-cache helpers on a small folder."""

from __future__ import annotations

from bench.startup_bench import evict, median_start, read_through, table


def test_median_start_keeps_one_starts_phases_together():
    starts = [
        {"load_weights": 5.0, "ready": 0.1},
        {"load_weights": 1.0, "ready": 0.1},
        {"load_weights": 2.0, "ready": 0.5},
    ]
    assert median_start(starts) == {"load_weights": 2.0, "ready": 0.5}
    assert median_start(starts[:2]) == {"load_weights": 1.0, "ready": 0.1}  # lower median


def test_table_has_a_row_per_start_and_dashes_for_phases_not_reached():
    rows = [{"model": "demo", "scenario": "warm", "phases": {"load_weights": 1.5, "ready": 0.25}}]
    text = table(rows).splitlines()
    assert text[0].startswith("| model | start | total s | load_weights | quantize |")
    assert text[2] == "| demo | warm | 1.75 | 1.50 | - | - | - | - | - | 0.25 |"


def test_page_cache_helpers_run_on_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"x" * 4096)
    read_through(tmp_path)
    evict(tmp_path)  # advisory: nothing to assert but that it runs without root
    assert (tmp_path / "sub" / "w.bin").read_bytes() == b"x" * 4096
