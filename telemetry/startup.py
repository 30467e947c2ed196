"""A start's phases as telemetry (SPEC section 13): moeserve_startup_phase_seconds{phase} and
a "startup" trace with one span per phase, from the marks of inference/startup.py (passed
in as plain data: (phase, time.monotonic() start) pairs and the end; this package imports no
inference code)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Gauge

from telemetry.tracing import get_tracer, monotonic_to_unix_converter

# inference.startup.PHASES, in the order a start usually goes through them
STARTUP_PHASES = (
    "load_weights",
    "quantize",
    "pack",
    "kv_cache_alloc",
    "compile",
    "warmup",
    "ready",
)


class StartupMetrics:
    """moeserve_startup_phase_seconds{model, phase}: every phase exported, 0 where the start
    did not go through it (no quantization, no torch.compile...)."""

    def __init__(self, registry: CollectorRegistry, model: str, budget_s: float = 0.0) -> None:
        """`budget_s`: how long a start may take (--startup-budget; 0: no budget), exported
        as moeserve_startup_budget_seconds for the MoeserveSlowStartup alert."""
        self.gauge = Gauge(
            "moeserve_startup_phase_seconds",
            "Seconds this server's start spent in each phase (load_weights from the start of "
            "`moeserve serve`; ready: the API built and listening around the loaded engine). "
            "Their sum is the start's duration.",
            ("model", "phase"),
            registry=registry,
        )
        self._children = {p: self.gauge.labels(model, p) for p in STARTUP_PHASES}
        for child in self._children.values():
            child.set(0)
        self.budget = Gauge(
            "moeserve_startup_budget_seconds",
            "How long a start may take (--startup-budget; 0: no budget).",
            ("model",),
            registry=registry,
        )
        self.budget.labels(model).set(budget_s)

    def set(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self._children[phase].set(value)


def record_startup_trace(
    marks: Sequence[tuple[str, float]], end: float, tracer: trace.Tracer | None = None
) -> None:
    """A root span "startup" over the whole start and one child span per mark, named after
    its phase (attribute moeserve.startup.phase), lasting until the next mark or `end`."""
    if not marks:
        return
    tracer = tracer or get_tracer()
    to_unix_ns = monotonic_to_unix_converter()
    root = tracer.start_span(
        "startup", context=trace.set_span_in_context(trace.INVALID_SPAN),
        start_time=to_unix_ns(marks[0][1]),
    )  # fmt: skip
    root.set_attribute("moeserve.startup.seconds", max(end - marks[0][1], 0.0))
    parent = trace.set_span_in_context(root)
    stops = [at for _, at in marks[1:]] + [end]
    for (phase, start), stop in zip(marks, stops, strict=True):
        span = tracer.start_span(
            phase,
            context=parent,
            start_time=to_unix_ns(start),
            attributes={"moeserve.startup.phase": phase},
        )
        span.end(end_time=to_unix_ns(max(stop, start)))
    root.end(end_time=to_unix_ns(end))
