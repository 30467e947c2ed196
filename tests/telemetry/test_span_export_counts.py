"""The trace exporter's fate of each span is counted (telemetry.tracing.SPAN_EXPORT) and
served on /metrics: exported, dropped because the exporter failed, dropped because the
bounded queue was full; a failing or stuck exporter never blocks the span's caller."""

from __future__ import annotations

import threading
import time

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest

from telemetry.metrics import ServiceMetrics
from telemetry.tracing import SPAN_EXPORT, SpanExportStats, build_tracer_provider


class _Exporter(SpanExporter):
    def __init__(self, result=SpanExportResult.SUCCESS, gate: threading.Event | None = None):
        self.result, self.gate, self.seen = result, gate, 0

    def export(self, spans):
        if self.gate is not None:
            self.gate.wait(10)
        self.seen += len(spans)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def shutdown(self):
        if self.gate is not None:
            self.gate.set()


def _delta(before: tuple[int, dict[str, int]]) -> tuple[int, dict[str, int]]:
    exported, dropped = SPAN_EXPORT.snapshot()
    return exported - before[0], {k: v - before[1][k] for k, v in dropped.items()}


def _spans(provider, n: int) -> None:
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span(f"s{i}"):
            pass


def test_exported_and_failed_batches_are_counted():
    for result, key in (
        (SpanExportResult.SUCCESS, "exported"),
        (SpanExportResult.FAILURE, "export_failed"),
        (RuntimeError("collector exploded"), "export_failed"),
    ):
        before = SPAN_EXPORT.snapshot()
        provider = build_tracer_provider("t", exporters=[_Exporter(result)])
        _spans(provider, 7)
        provider.force_flush()
        provider.shutdown()
        exported, dropped = _delta(before)
        got = exported if key == "exported" else dropped[key]
        assert got == 7, (result, exported, dropped)
        assert exported + sum(dropped.values()) == 7


def test_a_full_queue_counts_drops_and_never_blocks(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    gate = threading.Event()  # the exporter hangs (a collector that never answers)
    before = SPAN_EXPORT.snapshot()
    provider = build_tracer_provider("t", exporters=[_Exporter(gate=gate)])
    start = time.monotonic()
    _spans(provider, 100)
    assert time.monotonic() - start < 2.0  # ending spans did not wait for the exporter
    _, dropped = _delta(before)
    # at most the queue (8) plus the batch being exported (4) survive
    assert dropped["queue_full"] >= 100 - 8 - 4, dropped
    gate.set()
    provider.shutdown()


def test_metrics_serve_the_counts():
    stats = SpanExportStats()
    stats.add_exported(5)
    stats.add_dropped("queue_full", 2)
    stats.add_dropped("export_failed", 3)
    metrics = ServiceMetrics(CollectorRegistry(), "demo", 1, 2, 4, span_export=stats)
    text = generate_latest(metrics.registry).decode()
    assert 'moeserve_trace_spans_exported_total{model="demo"} 5.0' in text
    assert 'moeserve_trace_spans_dropped_total{model="demo",reason="queue_full"} 2.0' in text
    assert 'moeserve_trace_spans_dropped_total{model="demo",reason="export_failed"} 3.0' in text
