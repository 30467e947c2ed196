"""The recorder's bounds and arithmetic on the engine's own data types (StepStats,
RequestTelemetry), without a server: per-request step lists, the log ring, the one-second
engine window, the slow threshold and the settings it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from opentelemetry.trace import INVALID_SPAN
from structlog.testing import capture_logs

from inference import InvalidParameterError, SamplingParams
from inference.outputs import StepStats
from service.inspector.engine_window import EngineWindow
from service.inspector.expert_view import experts_view
from service.inspector.log_ring import LogRing
from service.inspector.recorder import InspectorRecorder
from service.inspector.requests import MAX_HEAD_STEPS, MAX_TAIL_STEPS
from service.observability import Observability, RequestTelemetry
from service.settings import Settings
from service.state_builder import build_inspector
from service.validation import GenerationInput

T0 = 1_800_000_000  # a Unix second


def _step(i: int, request_ids: list[str], second: int = T0, experts=None, **kw) -> StepStats:
    fields = {
        "started": 100.0 + i * 0.01,
        "started_unix_ns": second * 1_000_000_000 + i,
        "duration_s": 0.004,
        "num_running": len(request_ids),
        "num_waiting": 0,
        "batch_size": len(request_ids),
        "num_prefill_tokens": 0,
        "num_decode_tokens": len(request_ids),
        "num_generated_tokens": len(request_ids),
        "kv_usage": 0.1,
        "kv_blocks_used": 4,
        "num_requests": len(request_ids),
        "num_preemptions": 0,
        "request_ids": request_ids,
        "expert_tokens": experts,
    }
    return StepStats(**{**fields, **kw})


def _admitted(recorder: InspectorRecorder, engine_id: str):
    telemetry = RequestTelemetry(Observability.disabled(), "rest", f"req-{engine_id}", INVALID_SPAN)
    record = recorder.open(telemetry)
    telemetry.engine_request_id = engine_id
    recorder.admit(record, GenerationInput([1, 2, 3], SamplingParams(max_tokens=4), "chat", True))
    return record, telemetry


def test_a_long_request_keeps_its_first_and_last_steps_only():
    recorder = InspectorRecorder(4)
    record, telemetry = _admitted(recorder, "long")
    for i in range(1000):
        recorder.on_step(_step(i, ["long", "other"]))
    assert record.num_steps == 1000
    kept = [s.index for s in record.steps]
    assert len(kept) == MAX_HEAD_STEPS + MAX_TAIL_STEPS
    assert kept[:MAX_HEAD_STEPS] == list(range(1, MAX_HEAD_STEPS + 1))
    assert kept[MAX_HEAD_STEPS:] == list(range(1000 - MAX_TAIL_STEPS + 1, 1001))
    telemetry.finish("ok")
    recorder.close(record, "200")
    assert record.outcome == "ok" and record.code == "200" and record.telemetry is None
    recorder.on_step(_step(1000, ["long"]))  # closed: no longer collects steps
    assert record.num_steps == 1000


def test_the_request_ring_drops_the_oldest():
    recorder = InspectorRecorder(3)
    records = [_admitted(recorder, f"r{i}")[0] for i in range(5)]
    assert list(recorder.records) == [r.id for r in records[2:]]
    assert recorder.recorded == 5
    assert recorder.find(records[0].id) is None and recorder.find("req-r1") is None
    assert recorder.find("req-r4") is records[4] and recorder.find("r3") is records[3]


def test_the_log_ring_is_bounded_in_traces_and_lines():
    ring = LogRing(max_traces=2, max_lines=3)
    for trace in ("a", "b", "c"):
        for i in range(5):
            ring.add(trace, f'{{"n": {i}}}')
    assert len(ring) == 2 and ring.lines("a") == []
    assert ring.lines("c") == ['{"n": 0}', '{"n": 1}', '{"n": 2}']


def test_engine_lines_arrive_with_the_steps():
    recorder = InspectorRecorder(2)
    line = '{"event":"request aborted","trace_id":"' + "a" * 32 + '"}'
    recorder.on_step(_step(0, [], batch_size=0, log_lines=[("a" * 32, line)]))
    assert recorder.logs.lines("a" * 32) == [line]
    assert recorder.steps == 0  # a step that only reports aborts is no step of anyone's


def test_engine_window_series_fill_gaps_and_the_heatmap_keeps_a_minute():
    window = EngineWindow(num_layers=2, num_experts=3)
    window.observe(_step(0, ["x"], second=T0 - 100, experts=[[100, 0, 0], [0, 100, 0]]))
    window.observe(_step(1, ["x"], second=T0 - 2, experts=[[1, 2, 3], [4, 5, 6]]))
    window.observe(_step(2, ["x", "y"], second=T0, experts=[[1, 0, 1], [0, 2, 0]]))
    window.observe(_step(3, ["x", "y"], second=T0, experts=[[1, 1, 1], [1, 1, 1]]))
    series = window.series(T0 + 0.5)
    assert series["start"] == T0 - 119 and len(series["step_ms"]) == 120
    assert series["step_ms"][-1] == pytest.approx(4.0) and series["step_ms"][-2] is None
    assert series["tokens_per_s"][-3:] == [1, 0, 4]
    assert series["batch_size"][-1] == 2.0
    assert series["tokens_per_s"][-101] == 1  # 100 s ago is still on the sparkline
    assert window.expert_tokens(T0 + 0.5) == [[3, 3, 5], [5, 8, 7]]  # not the one 100 s ago
    assert EngineWindow(2, 3).expert_tokens(T0) == [[0, 0, 0], [0, 0, 0]]  # idle: zeros


def test_expert_view_of_a_deepseek_v3_shaped_window():
    """58 MoE layers x 256 experts: per layer the 8 busiest experts and max/mean, every
    expert's count in the grid; an idle layer lists none."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(58, 256))
    counts[7] = 0
    counts[3, 200] = 10_000
    window = EngineWindow(num_layers=58, num_experts=256)
    window.observe(_step(0, ["x"], second=T0, experts=counts.tolist()))
    window.observe(_step(1, ["x"], second=T0, experts=counts))  # arrays are taken too
    view = experts_view(window.expert_counts(T0), 60)
    assert view.num_experts == 256 and np.array_equal(view.tokens, 2 * counts)
    assert len(view.layers) == 58
    for layer in view.layers:
        row = 2 * counts[layer.layer]
        assert layer.tokens == row.sum()
        got = [h.tokens for h in layer.top]
        assert got == sorted(row[row > 0].tolist(), reverse=True)[:8]
        assert all(row[h.expert] == h.tokens for h in layer.top)
    assert view.layers[3].top[0].expert == 200
    assert view.layers[3].imbalance == pytest.approx(
        2 * 10_000 * 256 / (2 * counts[3].sum()), abs=1e-3
    )
    assert view.layers[7].top == [] and view.layers[7].imbalance == 0.0
    window.observe(_step(2, ["x"], second=T0, experts=[[1, 2]]))  # not the model's shape
    assert np.array_equal(window.expert_counts(T0), 2 * counts)


def test_slow_threshold_is_the_p95_of_e2e():
    recorder = InspectorRecorder(100)
    for i in range(1, 21):
        record, _ = _admitted(recorder, f"s{i}")
        record.latencies = SimpleNamespace(e2e=i / 10)
    assert recorder.slow_threshold_s() == pytest.approx(1.9)  # nearest rank: the 19th of 20
    assert InspectorRecorder(3).slow_threshold_s() is None


def test_settings_it_refuses_fail_the_start():
    with pytest.raises(InvalidParameterError, match="inspector_requests"):
        InspectorRecorder(0)
    with pytest.raises(InvalidParameterError, match="trace_id"):
        build_inspector(Settings(trace_url_template="http://tempo/trace/{id}"))
    assert build_inspector(Settings(no_inspector=True)) is None
    recorder = build_inspector(Settings(trace_url_template="http://t/{trace_id}", log_prompts=True))
    assert recorder.log_prompts and recorder.trace_url("ab" * 16) == "http://t/" + "ab" * 16


def test_a_failing_hook_is_logged_not_raised():
    recorder = InspectorRecorder(2)
    record, _ = _admitted(recorder, "x")
    with capture_logs() as logs:
        assert recorder.admit(record, None) is None  # no spec: the hook fails inside
    assert [(e["event"], e["hook"]) for e in logs] == [("inspector hook failed", "admit")]
