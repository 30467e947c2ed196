"""Collectors that build their samples at scrape time (no prometheus_client children on
the hot path): per-expert routed tokens and load imbalance, and the trace exporter's
delivered/dropped span counts. `ServiceMetrics` (telemetry.metrics) registers both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import add, sub
from typing import Any

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ExpertLoadCollector", "SpanExportCollector"]


class ExpertLoadCollector(Collector):
    """Per-expert routed-token totals and per-layer max/mean load over a sliding window of
    the last `window_steps` steps.

    Plain int lists updated in place with C-level map() per layer (each step is
    O(layers * experts) with no Python loop over experts and no prometheus locks); the
    samples are built only when Prometheus scrapes. One writer (the stats consumer);
    a scrape racing a step may see that step half-applied, never a decreasing counter.
    """

    def __init__(self, model: str, num_layers: int, num_experts: int, window_steps: int) -> None:
        self.model = model
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window_steps = window_steps
        self.totals = [[0] * num_experts for _ in range(num_layers)]
        self.window = [[0] * num_experts for _ in range(num_layers)]  # sums over the ring
        self._ring = [[[0] * num_experts for _ in range(num_layers)] for _ in range(window_steps)]
        self._pos = 0
        self._zeros = [0] * num_experts

    def observe(self, expert_tokens: Sequence[Sequence[int]]) -> None:
        slot = self._ring[self._pos]
        self._pos = (self._pos + 1) % self.window_steps
        num_experts = self.num_experts
        for layer in range(self.num_layers):
            new = expert_tokens[layer] if layer < len(expert_tokens) else self._zeros
            if len(new) != num_experts:  # clip/pad: labels stay within the model's shape
                new = [*new[:num_experts], *self._zeros[len(new) :]]
            old, window, totals = slot[layer], self.window[layer], self.totals[layer]
            totals[:] = map(add, totals, new)
            window[:] = map(sub, map(add, window, new), old)
            old[:] = new

    def imbalance(self, layer: int) -> float:
        """max/mean expert load of `layer` over the window; 0.0 when nothing was routed."""
        window = self.window[layer]
        total = sum(window)
        return max(window) * self.num_experts / total if total else 0.0

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        tokens = CounterMetricFamily(
            "moeserve_moe_expert_tokens",
            "Tokens routed to each expert.",
            labels=("model", "layer", "expert"),
        )
        imbalance = GaugeMetricFamily(
            "moeserve_moe_expert_imbalance",
            f"Max/mean expert load per layer over the last {self.window_steps} steps "
            "(1 = balanced, num_experts = one expert takes all; 0 = no tokens routed).",
            labels=("model", "layer"),
        )
        return tokens, imbalance

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        tokens, imbalance = self._families()
        for layer in range(self.num_layers):
            name = str(layer)
            for expert, count in enumerate(list(self.totals[layer])):
                tokens.add_metric((self.model, name, str(expert)), count)
            imbalance.add_metric((self.model, name), self.imbalance(layer))
        return tokens, imbalance


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
