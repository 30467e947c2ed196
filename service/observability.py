"""Telemetry of the served model (SPEC section 8), built once at start-up (state_builder.py).

Engine steps become metrics and step spans linked to the live requests' spans. Each
generation request gets a RequestTelemetry, owned by its service.generation.Generation: the
GenAI attributes on its server span, the engine's `log_context` (trace_id, span_id,
request_id) for the lines the engine logs on its behalf, and when it is over the phase
spans, the request metrics (trace-id exemplars) and the one summary log line
(telemetry.requests.finish_request).

Telemetry never fails a request: the hooks catch and log their own errors (the engine guards
its stats listeners the same way), export runs on the SDK's worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, Status, StatusCode

from telemetry.logging import get_logger
from telemetry.metrics import NO_KEY, ServiceMetrics
from telemetry.requests import finish_request, finish_unserved_request, merged_times
from telemetry.tracing import (
    genai_request_attributes,
    genai_response_attributes,
    genai_span_name,
    get_tracer,
    record_step_span,
    span_ids,
)

log = get_logger("service.observability")

MAX_LIVE_SPANS = 16384  # request id -> span context for step-span links (bounded)
# SamplingParams fields the GenAI request attributes take by the same name
_GENAI_PARAMS = (
    *("max_tokens", "temperature", "top_p", "top_k", "seed"),
    *("frequency_penalty", "presence_penalty"),
)
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
        self.cost: Any = None  # telemetry.cost.CostCollector with --cost-per-hour
        # telemetry.api_requests.ApiRequests: requests by type and status (with metrics)
        self.api_requests: Any = None
        # telemetry.genai_metrics.GenAIServerMetrics, under the GenAI semconv opt-in (OTLP)
        self.genai_metrics: Any = None
        self._typical_decode_s: float | None = None  # moving average of routine decode steps
        self._routine_steps = 0

    @classmethod
    def disabled(cls) -> Observability:
        return cls("", enabled=False, tracer=trace.NoOpTracer())

    def add_keys(self, labels: dict[str, tuple[str, ...]]) -> None:
        """API key names (-> their configured limits) the request metrics export from now on
        (service.api_keys.KeyRing.labels; at start-up and after each reload)."""
        if self.metrics is not None:
            for key, limits in labels.items():
                self.metrics.add_key(key, limits)

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


class RequestTelemetry:
    """One API request's telemetry; `admit` when it enters the engine, `finish` once."""

    def __init__(self, obs: Observability, api: str, request_id: str, span: Span) -> None:
        """`span`: the server span the request's transport opened and ends (REST: the
        OpenTelemetryPlugin's, gRPC: grpc_server's)."""
        self.obs, self.api, self.request_id, self.span = obs, api, request_id, span
        self.key = NO_KEY  # the name of the request's API key (service.api_keys)
        self.engine_request_id: str | None = None
        self.output: Any = None
        self.prompt_ids: list[int] | None = None
        self.failure: BaseException | None = None
        self.failed_status: str | None = None
        self.abandoned = False  # the caller left before the end (disconnect, cancel, deadline)
        self.done = False
        self.status: str | None = None  # the requests_total status, once finished
        self.operation: str | None = None  # the GenAI operation, once admitted

    # ---- while serving --------------------------------------------------------------------
    def admit(self, engine_request_id: str, spec: Any, log_context: dict) -> dict:
        """The request enters the engine (spec: its validation.GenerationInput): GenAI
        attributes on the server span, the span context registered for step links; returns
        the engine's log_context."""
        self.engine_request_id = engine_request_id
        self.prompt_ids = spec.prompt_ids
        self.operation = spec.operation
        context = {**log_context, "request_id": self.request_id, "api": self.api, "key": self.key}
        try:
            self._describe(engine_request_id, spec)
            constraint = spec.params.structured_outputs
            if constraint is not None and self.obs.metrics is not None:
                self.obs.metrics.count_structured(constraint.kind)
            ids = span_ids(self.span)
            if ids is not None:
                context["trace_id"], context["span_id"] = ids
                if len(self.obs.live) < MAX_LIVE_SPANS:
                    self.obs.live[engine_request_id] = self.span.get_span_context()
        except Exception:  # telemetry must never fail a request
            log.exception("request telemetry failed", request_id=self.request_id)
        return context

    def _describe(self, engine_request_id: str, spec: Any) -> None:
        span, model, params = self.span, self.obs.model, spec.params
        if not span.is_recording():
            return
        span.update_name(genai_span_name(spec.operation, model))
        request = {name: getattr(params, name) for name in _GENAI_PARAMS}
        span.set_attributes(
            genai_request_attributes(
                spec.operation,
                model,
                choice_count=params.n,
                stream=spec.stream,
                stop_sequences=params.stop,
                **request,
            )
        )
        span.set_attributes(
            genai_response_attributes(response_id=engine_request_id, response_model=model)
        )
        span.set_attribute("moeserve.request_id", self.request_id)

    def observe(self, output: Any) -> None:
        self.output = output

    def rate_limited(self, limit: str) -> None:
        """The request was refused for its key's `limit` (moeserve_rate_limited_total)."""
        if self.obs.metrics is not None:
            try:
                self.obs.metrics.count_rate_limited(self.api, self.key, limit)
            except Exception:  # telemetry must never fail a request
                log.exception("request telemetry failed", request_id=self.request_id)

    def fail(self, exc: BaseException | None, status: str) -> None:
        """Records a failure (first one wins); the exception goes on the span unless it is
        the caller going away."""
        if self.failed_status is not None:
            return
        self.failed_status = status
        self.abandoned = exc is None or isinstance(exc, (asyncio.CancelledError, GeneratorExit))
        if self.abandoned:
            return
        self.failure = exc
        if self.span.is_recording():
            self.span.record_exception(exc)

    # ---- the end --------------------------------------------------------------------------
    def finish(self, status: str) -> None:
        """Once, when the API layer has answered: status is its view (HTTP / gRPC code);
        a failure seen during generation takes precedence."""
        if self.done:
            return
        self.done = True
        self.status = self.failed_status or status
        if not self.obs.enabled:
            return
        try:
            self._finish(self.status)
        except Exception:  # telemetry must never fail a request
            log.exception("request telemetry failed", request_id=self.request_id)
        finally:
            if self.engine_request_id is not None:
                self.obs.live.pop(self.engine_request_id, None)

    def _finish(self, status: str) -> None:
        obs, span, out = self.obs, self.span, self.output
        if status != "ok" and span.is_recording():
            exc = self.failure
            span.set_attribute("error.type", type(exc).__name__ if exc is not None else status)
            span.set_status(
                Status(StatusCode.ERROR, f"{status}: {exc}" if exc is not None else status)
            )
        extra: dict[str, Any] = {"model": obs.model}
        common = {
            "api": self.api,
            "request_id": self.request_id,
            "status": status,
            "logger": log,
            "key": self.key,
        }
        times = merged_times(out.outputs) if out is not None else None
        if times is None:  # never produced an output: rejected, invalid, aborted while queued
            num_prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
            if span.is_recording() and self.engine_request_id is not None:
                span.set_attributes(
                    genai_response_attributes(input_tokens=num_prompt, output_tokens=0)
                )
            if obs.log_prompts:
                extra["prompt"] = self._prompt_text()
            finish_unserved_request(
                span,
                num_prompt_tokens=num_prompt,
                finish_reason=self.finish_reason,
                metrics=obs.metrics,
                **common,
                **extra,
            )
            return
        reasons = [c.finish_reason for c in out.outputs]
        finish_reason = self.finish_reason
        if out.finished and len(set(reasons)) > 1:
            extra["finish_reasons"] = reasons
        if obs.log_prompts:
            extra["prompt"] = self._prompt_text(out.prompt_token_ids)
            texts = [c.text for c in out.outputs]
            extra["output"] = texts[0] if len(texts) == 1 else texts
        latencies = finish_request(
            span,
            times=times,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=sum(len(c.token_ids) for c in out.outputs),
            finish_reason=finish_reason,
            metrics=obs.metrics,
            tracer=obs.tracer,
            **common,
            **extra,
        )
        if span.is_recording() and len(reasons) > 1:
            span.set_attribute("gen_ai.response.finish_reasons", [r or "abort" for r in reasons])
        drafted = sum(c.times.spec_draft_tokens for c in out.outputs if c.times is not None)
        if drafted and span.is_recording():  # speculative decoding: what its drafts achieved
            accepted = sum(c.times.spec_accepted_tokens for c in out.outputs if c.times)
            span.set_attributes(
                {
                    "moeserve.spec_decode.num_draft_tokens": drafted,
                    "moeserve.spec_decode.num_accepted_tokens": accepted,
                    "moeserve.spec_decode.acceptance_rate": accepted / drafted,
                }
            )
        if obs.genai_metrics is not None:
            failure = self.failure
            error = None if status == "ok" else type(failure).__name__ if failure else status
            obs.genai_metrics.record(latencies, self.operation, error)

    @property
    def finish_reason(self) -> str | None:
        """The request's finish reason: the first sample's once finished; "error" or "abort"
        when it ended early (aborted while queued: "abort"; refused: None)."""
        out = self.output
        if out is None or merged_times(out.outputs) is None:
            return "abort" if self.engine_request_id is not None and self.abandoned else None
        if out.finished:
            return out.outputs[0].finish_reason
        return "error" if self.failure is not None else "abort"

    def _prompt_text(self, ids: list[int] | None = None) -> str | None:
        ids = ids if ids is not None else self.prompt_ids
        if ids is None or self.obs.decode is None:
            return None
        return self.obs.decode(ids)
