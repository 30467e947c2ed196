"""Start-up phases as telemetry: the gauge per phase and the "startup" trace (the phases of a
real start: tests/service/test_startup_phases.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from inference.startup import PHASES, PhaseMark, StartupClock, phase_order, phase_seconds
from telemetry.startup import STARTUP_PHASES, StartupMetrics, record_startup_trace


def test_the_telemetry_names_the_engines_phases():
    assert STARTUP_PHASES == PHASES  # telemetry imports no inference code: kept equal here


def test_marks_partition_the_start_and_repeated_phases_add_up():
    marks = [
        PhaseMark("load_weights", 10.0),
        PhaseMark("compile", 12.0),
        PhaseMark("pack", 12.5),
        PhaseMark("kv_cache_alloc", 13.0),
        PhaseMark("compile", 13.25),
        PhaseMark("ready", 14.0),
    ]
    seconds = phase_seconds(marks, 15.0)
    assert seconds == {
        "load_weights": 2.0,
        "quantize": 0.0,
        "pack": 0.5,
        "kv_cache_alloc": 0.25,
        "compile": 0.5 + 0.75,
        "warmup": 0.0,
        "ready": 1.0,
    }
    assert sum(seconds.values()) == 5.0
    assert phase_order(marks) == ["load_weights", "compile", "pack", "kv_cache_alloc", "ready"]


def test_clock_hears_each_mark_and_refuses_unknown_phases():
    heard = []
    clock = StartupClock(heard.append)
    clock.mark("load_weights")
    clock.mark("warmup")
    assert [m.phase for m in heard] == ["load_weights", "warmup"] and heard == clock.marks
    try:
        clock.mark("loading")
    except ValueError as exc:
        assert "loading" in str(exc)
    else:
        raise AssertionError("an unknown phase was accepted")


def test_gauge_exports_every_phase():
    registry = CollectorRegistry()
    metrics = StartupMetrics(registry, "m")
    value = lambda p: registry.get_sample_value(
        "moeserve_startup_phase_seconds", {"model": "m", "phase": p}
    )
    assert [value(p) for p in PHASES] == [0.0] * len(PHASES)
    metrics.set({"load_weights": 1.5, "ready": 0.25})
    assert value("load_weights") == 1.5 and value("ready") == 0.25 and value("pack") == 0.0
    assert registry.get_sample_value("moeserve_startup_budget_seconds", {"model": "m"}) == 0
    budgeted = CollectorRegistry()
    StartupMetrics(budgeted, "m", 90.0)
    assert budgeted.get_sample_value("moeserve_startup_budget_seconds", {"model": "m"}) == 90


def test_startup_trace_has_a_span_per_mark_under_one_root(tracer, span_exporter):
    marks = [("load_weights", 100.0), ("kv_cache_alloc", 101.0), ("ready", 101.5)]
    record_startup_trace(marks, 102.0, tracer)
    spans = span_exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "startup"]
    children = [s for s in spans if s.name != "startup"]
    assert [s.name for s in children] == ["load_weights", "kv_cache_alloc", "ready"]
    assert all(s.parent.span_id == root.context.span_id for s in children)
    assert root.parent is None
    durations = [(s.end_time - s.start_time) / 1e9 for s in children]
    assert durations == [1.0, 0.5, 0.5]
    assert root.start_time == children[0].start_time and root.end_time == children[-1].end_time


def test_a_line_is_logged_as_each_phase_ends(log_stream):
    import json
    import time

    from service.startup import StartupProgress

    progress = StartupProgress()
    progress.on_engine_phase(PhaseMark("load_weights", time.monotonic()))  # continues ours
    progress.on_engine_phase(PhaseMark("kv_cache_alloc", time.monotonic()))
    progress.mark("ready")
    progress.finish()
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    phases = [line["phase"] for line in lines if line["event"] == "startup phase"]
    assert phases == ["load_weights", "kv_cache_alloc", "ready"]
    (done,) = [line for line in lines if line["event"] == "startup finished"]
    assert done["seconds"] == pytest.approx(sum(progress.seconds().values()), abs=0.002)
    assert [p["phase"] for p in progress.report()] == phases
