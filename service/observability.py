"""Telemetry of the served model (SPEC section 8), built once at start-up (server.py): engine
steps become metrics and step spans linked to the live requests' spans, and each generation
request gets its RequestTelemetry (service/request_telemetry.py).

Telemetry never fails a request: the hooks catch and log their own errors (the engine guards
its stats listeners the same way), export runs on the SDK's worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, SpanKind

from service.request_telemetry import RequestTelemetry
from telemetry.metrics import ServiceMetrics
from telemetry.tracing import get_tracer, record_step_span

# Routine decode steps (no prefill, no preemption, not slow) get a span one time in this many;
# the others always do. At ~30 steps/s per replica, spans for every routine step were about
# half of telemetry's CPU (building and OTLP-encoding them) for no diagnostic value.
ROUTINE_STEP_SPAN_EVERY = 16
SLOW_STEP_FACTOR = 2.0  # a step this many times the typical decode step is never routine


class Observability:
    """The process's telemetry for one served model; `Observability.disabled()` is a no-op."""

    def __init__(
        self,
        model: str,
        *,
        metrics: ServiceMetrics | None = None,
        tracer: trace.Tracer | None = None,
        tracer_provider: Any = None,
        log_prompts: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        enabled: bool = True,
    ) -> None:
        self.model = model
        self.enabled = enabled
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.tracer = tracer or (
            tracer_provider.get_tracer("moeserve") if tracer_provider else get_tracer()
        )
        self.log_prompts = log_prompts
        self.decode = decode
        self.live: dict[str, SpanContext] = {}
        self._typical_decode_s: float | None = None  # moving average of routine decode steps
        self._routine_steps = 0

    @classmethod
    def disabled(cls) -> Observability:
        return cls("", enabled=False, tracer=trace.NoOpTracer())

    # ---- engine steps ---------------------------------------------------------------------
    def on_step(self, stats: Any) -> None:
        """Stats listener (event loop, after every step): metrics and the step span."""
        if not self.enabled:
            return
        if self.metrics is not None:
            self.metrics.observe_step(stats)
        if (stats.batch_size or stats.request_ids) and self._wants_step_span(stats):
            record_step_span(stats, self.live.get, tracer=self.tracer)

    def _wants_step_span(self, stats: Any) -> bool:
        """Every step that prefilled, preempted or ran slow (SLOW_STEP_FACTOR x the typical
        decode step) gets a span, so a slow request's trace shows the steps that slowed it;
        one routine decode step in ROUTINE_STEP_SPAN_EVERY does too."""
        if stats.num_prefill_tokens or stats.num_preemptions:
            return True
        typical = self._typical_decode_s
        if typical is not None and stats.duration_s > SLOW_STEP_FACTOR * typical:
            return True
        self._typical_decode_s = (
            stats.duration_s if typical is None else 0.9 * typical + 0.1 * stats.duration_s
        )
        self._routine_steps += 1
        return self._routine_steps % ROUTINE_STEP_SPAN_EVERY == 1

    # ---- requests -------------------------------------------------------------------------
    def request(self, api: str, request_id: str, span: Span | None = None) -> RequestTelemetry:
        """A request's telemetry; `span` is the server span its transport opened (REST: the
        OpenTelemetryPlugin's, gRPC: grpc_server's), None for a span of its own, which the
        request ends (direct callers, tests)."""
        if span is not None or not self.enabled:  # disabled: a span that records nothing
            span = span if span is not None else trace.INVALID_SPAN
            return RequestTelemetry(self, api, request_id, span, owns_span=False)
        parent = trace.get_current_span().get_span_context()
        kind = SpanKind.INTERNAL if parent.is_valid else SpanKind.SERVER
        return RequestTelemetry(
            self, api, request_id, self.tracer.start_span(api, kind=kind), owns_span=True
        )
