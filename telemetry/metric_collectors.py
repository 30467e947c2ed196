"""Collectors that build their samples at scrape time (no prometheus_client children on
the hot path): the trace exporter's delivered/dropped span counts here, the experts' load
in telemetry.expert_load. `ServiceMetrics` (telemetry.metrics) registers both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["SpanExportCollector"]


class SpanExportCollector(Collector):
    """What became of the process's ended spans, read from a `SpanExportStats` at scrape
    time: exported, or dropped (queue_full: the exporter fell behind; export_failed: the
    collector was down, refused or timed out). A rising drop rate is the exporter alert's
    signal; requests never wait for the exporter."""

    def __init__(self, model: str, stats: Any) -> None:
        self.model, self.stats = model, stats

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily]:
        exported = CounterMetricFamily(
            "moeserve_trace_spans_exported",
            "Spans the trace exporter delivered.",
            labels=("model",),
        )
        dropped = CounterMetricFamily(
            "moeserve_trace_spans_dropped",
            "Spans lost before delivery: queue_full (the exporter fell behind and the "
            "bounded span queue was full) or export_failed (the collector was down, "
            "refused the batch or timed out).",
            labels=("model", "reason"),
        )
        return exported, dropped

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        exported, dropped = self._families()
        n_exported, n_dropped = self.stats.snapshot()
        exported.add_metric((self.model,), n_exported)
        for reason, count in n_dropped.items():
            dropped.add_metric((self.model, reason), count)
        return exported, dropped
