"""One generation request's telemetry (SPEC section 8), owned by its service.generation
.Generation: the GenAI attributes on the request's server span, the engine's `log_context`
(trace_id, span_id, request_id) for the lines it logs on the request's behalf, and when the
request is over the phase spans, the request metrics (trace-id exemplars) and the one
summary log line (telemetry.requests.finish_request).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, Status, StatusCode

from telemetry.logging import get_logger
from telemetry.requests import finish_request, finish_unserved_request, merged_times
from telemetry.tracing import (
    genai_request_attributes,
    genai_response_attributes,
    genai_span_name,
    span_ids,
)

if TYPE_CHECKING:
    from service.observability import Observability

log = get_logger("service.observability")

MAX_LIVE_SPANS = 16384  # request id -> span context for step-span links (bounded)


class RequestTelemetry:
    """One API request's telemetry; `admit` when it enters the engine, `finish` once."""

    def __init__(
        self, obs: Observability, api: str, request_id: str, span: Span, owns_span: bool
    ) -> None:
        self.obs, self.api, self.request_id, self.span = obs, api, request_id, span
        self.owns_span = owns_span
        self.engine_request_id: str | None = None
        self.output: Any = None
        self.prompt_ids: list[int] | None = None
        self.failure: BaseException | None = None
        self.failed_status: str | None = None
        self.abandoned = False  # the caller left before the end (disconnect, cancel, deadline)
        self.done = False

    # ---- while serving --------------------------------------------------------------------
    def admit(self, engine_request_id: str, spec: Any, log_context: dict) -> dict:
        """The request enters the engine (spec: its validation.GenerationInput): GenAI
        attributes on the server span, the span context registered for step links; returns
        the engine's log_context."""
        self.engine_request_id = engine_request_id
        self.prompt_ids = spec.prompt_ids
        context = {**log_context, "request_id": self.request_id, "api": self.api}
        try:
            self._describe(engine_request_id, spec.params, spec.operation, spec.stream)
            ids = span_ids(self.span)
            if ids is not None:
                context["trace_id"], context["span_id"] = ids
                if len(self.obs.live) < MAX_LIVE_SPANS:
                    self.obs.live[engine_request_id] = self.span.get_span_context()
        except Exception:  # telemetry must never fail a request
            log.exception("request telemetry failed", request_id=self.request_id)
        return context

    def _describe(
        self, engine_request_id: str, params: Any, operation: str, stream: bool | None
    ) -> None:
        span = self.span
        if not span.is_recording():
            return
        model = self.obs.model
        span.update_name(genai_span_name(operation, model))
        span.set_attributes(
            genai_request_attributes(
                operation,
                model,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                choice_count=params.n,
                stream=stream,
                stop_sequences=params.stop,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
            )
        )
        span.set_attributes(
            genai_response_attributes(response_id=engine_request_id, response_model=model)
        )
        span.set_attribute("moeserve.request_id", self.request_id)

    def observe(self, output: Any) -> None:
        self.output = output

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
        if not self.obs.enabled:
            return
        try:
            self._finish(self.failed_status or status)
        except Exception:  # telemetry must never fail a request
            log.exception("request telemetry failed", request_id=self.request_id)
        finally:
            if self.engine_request_id is not None:
                self.obs.live.pop(self.engine_request_id, None)
            if self.owns_span:
                self.span.end()

    def _finish(self, status: str) -> None:
        obs, span, out = self.obs, self.span, self.output
        if status != "ok" and span.is_recording():
            exc = self.failure
            span.set_attribute("error.type", type(exc).__name__ if exc is not None else status)
            span.set_status(
                Status(StatusCode.ERROR, f"{status}: {exc}" if exc is not None else status)
            )
        extra: dict[str, Any] = {"model": obs.model}
        times = merged_times(out.outputs) if out is not None else None
        if times is None:  # never produced an output: rejected, invalid, aborted while queued
            finish_reason = (
                "abort" if self.engine_request_id is not None and self.abandoned else None
            )
            num_prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
            if span.is_recording() and self.engine_request_id is not None:
                span.set_attributes(
                    genai_response_attributes(input_tokens=num_prompt, output_tokens=0)
                )
            if obs.log_prompts:
                extra["prompt"] = self._prompt_text()
            finish_unserved_request(
                span,
                api=self.api,
                request_id=self.request_id,
                num_prompt_tokens=num_prompt,
                finish_reason=finish_reason,
                status=status,
                metrics=obs.metrics,
                logger=log,
                **extra,
            )
            return
        reasons = [c.finish_reason for c in out.outputs]
        finish_reason = (
            reasons[0] if out.finished else "error" if self.failure is not None else "abort"
        )
        if out.finished and len(set(reasons)) > 1:
            extra["finish_reasons"] = reasons
        if obs.log_prompts:
            extra["prompt"] = self._prompt_text(out.prompt_token_ids)
            texts = [c.text for c in out.outputs]
            extra["output"] = texts[0] if len(texts) == 1 else texts
        finish_request(
            span,
            api=self.api,
            request_id=self.request_id or "",
            times=times,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=sum(len(c.token_ids) for c in out.outputs),
            finish_reason=finish_reason,
            status=status,
            metrics=obs.metrics,
            logger=log,
            tracer=obs.tracer,
            **extra,
        )
        if span.is_recording() and len(reasons) > 1:
            span.set_attribute("gen_ai.response.finish_reasons", [r or "abort" for r in reasons])

    def _prompt_text(self, ids: list[int] | None = None) -> str | None:
        ids = ids if ids is not None else self.prompt_ids
        if ids is None or self.obs.decode is None:
            return None
        return self.obs.decode(ids)
