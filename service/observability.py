"""Per-request telemetry shared by the REST and gRPC APIs (SPEC section 8).

`Observability` is built once at start-up (server.py) and lives on `ServingState`. The API
layer opens a request scope where its server span is current (REST: Litestar's
OpenTelemetryPlugin span; gRPC: `GrpcTelemetryInterceptor`'s own span), and
`ServingState.generate` — the one path into the engine — finds it through a contextvar,
names the span after the GenAI operation, sets the GenAI request attributes and hands the
engine a `log_context` (trace_id, span_id, request_id) for the lines it logs on the
request's behalf from its thread. When the API layer knows the final status, `finish`
records the phase spans, the request metrics (trace-id exemplars) and the one summary log
line (telemetry.requests.finish_request). Engine steps become spans of their own linked to
the live request spans (`on_step`, a stats listener).

Telemetry never fails a request: the request hooks catch and log their own errors (the
engine guards its stats listeners the same way), export runs on the SDK's worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

import grpc
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanContext, SpanKind, Status, StatusCode

from service.errors import ServiceError
from telemetry.logging import bind_request_context, get_logger
from telemetry.metrics import ServiceMetrics, status_from_grpc, status_from_http
from telemetry.requests import finish_request
from telemetry.tracing import (
    extract_context,
    genai_request_attributes,
    genai_response_attributes,
    genai_span_name,
    get_tracer,
    inject_traceparent,
    record_step_span,
)

log = get_logger("service.observability")

MAX_LIVE_SPANS = 16384  # request id -> span context for step-span links (bounded)
# Routine decode steps (no prefill, no preemption, not slow) get a span one time in this many;
# the others always do. At ~30 steps/s per replica, spans for every routine step were about
# half of telemetry's CPU (building and OTLP-encoding them) for no diagnostic value.
ROUTINE_STEP_SPAN_EVERY = 16
SLOW_STEP_FACTOR = 2.0  # a step this many times the typical decode step is never routine
_OPERATIONS = {"openai.chat": "chat", "openai.completions": "text_completion"}
_CURRENT: ContextVar[RequestTelemetry | None] = ContextVar("moeserve_request", default=None)


def api_label(api: str) -> str:
    """`api` as ServingState.generate gets it ("openai.chat", "grpc", ...) -> rest | grpc."""
    return "grpc" if api.startswith("grpc") else "rest"


def genai_operation(api: str) -> str:
    """The GenAI operation name of a generation from `api` ("openai.chat" -> "chat")."""
    return _OPERATIONS.get(api, "text_completion")


def status_of(exc: BaseException) -> str:
    """requests_total status of an exception seen while serving."""
    if isinstance(exc, ServiceError):
        return status_from_http(exc.status_code)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "client_error"  # the caller went away (disconnect, cancel, deadline)
    return "server_error"


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
    @contextmanager
    def request_scope(
        self, api: str, request_id: str | None, span: Span
    ) -> Iterator[RequestTelemetry]:
        """The API layer's request: `span` is its server span (current while it runs)."""
        rt = (
            RequestTelemetry(self, api_label(api), request_id, span, owns_span=False)
            if self.enabled
            else _NULL
        )
        token = _CURRENT.set(rt)
        try:
            yield rt
        finally:
            _CURRENT.reset(token)

    def request(self, api: str, request_id: str) -> tuple[RequestTelemetry, bool]:
        """The current request scope's telemetry, or (no API layer: direct callers, tests)
        a new one with a span of its own that the caller finishes. Returns (it, owned)."""
        rt = _CURRENT.get()
        if rt is not None:
            return rt, False
        if not self.enabled:
            return _NULL, False
        parent = trace.get_current_span().get_span_context()
        kind = SpanKind.INTERNAL if parent.is_valid else SpanKind.SERVER
        span = self.tracer.start_span(api, kind=kind)
        return RequestTelemetry(self, api_label(api), request_id, span, owns_span=True), True


def record_error(exc: BaseException, status: str) -> None:
    """An error the API layer answers with (REST error handler, gRPC status mapping): on the
    request's telemetry, or on the current span outside generation requests."""
    rt = _CURRENT.get()
    if rt is not None:
        rt.fail(exc, status)
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class RequestTelemetry:
    """One API request's telemetry; `admit` when it enters the engine, `finish` once."""

    def __init__(
        self, obs: Observability, api: str, request_id: str | None, span: Span, owns_span: bool
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
    def admit(
        self,
        engine_request_id: str,
        prompt: Any,
        params: Any,
        operation: str,
        stream: bool | None,
        log_context: dict | None,
    ) -> dict | None:
        """The request enters the engine: GenAI attributes on the server span, the span
        context registered for step links; returns the engine's log_context."""
        self.engine_request_id = engine_request_id
        if isinstance(prompt, list):
            self.prompt_ids = prompt
        if self.request_id is None:  # gRPC: the id is inside the message
            self.request_id = engine_request_id
            structlog.contextvars.bind_contextvars(request_id=engine_request_id)
        context = {**(log_context or {}), "request_id": self.request_id, "api": self.api}
        try:
            self._describe(engine_request_id, params, operation, stream)
            ctx = self.span.get_span_context()
            if ctx.is_valid:
                context["trace_id"] = format(ctx.trace_id, "032x")
                context["span_id"] = format(ctx.span_id, "016x")
                if len(self.obs.live) < MAX_LIVE_SPANS:
                    self.obs.live[engine_request_id] = ctx
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
        times = _merged_times(out.outputs) if out is not None else None
        if times is None:  # never produced an output: rejected, invalid, aborted while queued
            finish_reason = (
                "abort" if self.engine_request_id is not None and self.abandoned else None
            )
            if obs.metrics is not None:
                obs.metrics.count_request(self.api, status, finish_reason)
            num_prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
            ids = _ids(span)
            if span.is_recording() and self.engine_request_id is not None:
                span.set_attributes(
                    genai_response_attributes(input_tokens=num_prompt, output_tokens=0)
                )
            if obs.log_prompts:
                extra["prompt"] = self._prompt_text()
            log.info(
                "request finished",
                request_id=self.request_id,
                api=self.api,
                prompt_tokens=num_prompt,
                completion_tokens=0,
                queue_ms=None,
                ttft_ms=None,
                tpot_ms=None,
                e2e_ms=None,
                finish_reason=finish_reason or "none",
                status=status,
                **ids,
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


class _NullRequest(RequestTelemetry):
    """Telemetry off: every hook is a no-op."""

    def __init__(self) -> None:
        super().__init__(None, "rest", None, INVALID_SPAN, owns_span=False)  # type: ignore[arg-type]

    def admit(self, engine_request_id, prompt, params, operation, stream, log_context):
        return {**(log_context or {}), "request_id": engine_request_id}

    def observe(self, output: Any) -> None:
        pass

    def fail(self, exc: BaseException | None, status: str) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


_NULL = _NullRequest()


def _ids(span: Span) -> dict[str, str]:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def _merged_times(outputs: list[Any]) -> Any:
    """One RequestTimes for the request: the sample's own, or for n > 1 the envelope of
    all samples (earliest start and first token, latest finish, preemptions summed)."""
    times = [c.times for c in outputs if c.times is not None]
    if len(times) <= 1:
        return times[0] if times else None

    def first(name: str) -> float | None:
        values = [getattr(t, name) for t in times if getattr(t, name) is not None]
        return min(values) if values else None

    finished = [t.finished for t in times]
    return SimpleNamespace(
        arrival=min(t.arrival for t in times),
        first_scheduled=first("first_scheduled"),
        first_token=first("first_token"),
        last_token=max((t.last_token for t in times if t.last_token is not None), default=None),
        finished=None if None in finished else max(finished),
        num_preemptions=sum(t.num_preemptions for t in times),
    )


# ---- REST ---------------------------------------------------------------------------------------
def rest_request_context(app: Any) -> Any:
    """App-level Litestar middleware: every line logged while a request is served carries
    its request_id (trace ids come from the current span, see telemetry.logging)."""
    from service.controllers.common import request_id

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            bind_request_context(request_id(scope))
        await app(scope, receive, send)

    return middleware


def rest_generation_telemetry(app: Any) -> Any:
    """Route middleware of the generation routes: the request's telemetry, finished with the
    HTTP status just before the last body message goes out (the OTel ASGI middleware ends
    the server span on that message)."""
    from service.controllers.common import request_id

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        obs: Observability = scope["app"].state.serving.observability
        if not obs.enabled:
            await app(scope, receive, send)
            return
        status_code = 500
        with obs.request_scope("rest", request_id(scope), trace.get_current_span()) as rt:

            async def send_and_finish(message: Any) -> None:
                nonlocal status_code
                kind = message["type"]
                if kind == "http.response.start":
                    status_code = message["status"]
                elif kind == "http.response.body" and not message.get("more_body", False):
                    rt.finish(status_from_http(status_code))
                await send(message)

            try:
                await app(scope, receive, send_and_finish)
            except asyncio.CancelledError:
                status_code = 499
                raise
            finally:
                rt.finish(status_from_http(status_code))

    return middleware


def traceparent_header() -> tuple[bytes, bytes] | None:
    """("traceparent", value) of the current span, for the response headers."""
    value = inject_traceparent(trace.get_current_span())
    return None if value is None else (b"traceparent", value.encode())


# ---- gRPC ---------------------------------------------------------------------------------------
class GrpcTelemetryInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per RPC of `service` continuing the caller's `traceparent` metadata and
    returning it as trailing metadata, with the request's log context and, for the
    generation methods, its request telemetry finished with the final status code.

    OpenTelemetry's own aio interceptor would iterate a streaming handler with `async for`;
    ours write with `context.write` (a coroutine), which it cannot wrap.
    """

    def __init__(
        self,
        obs: Observability,
        service: str,
        generation_methods: tuple[str, ...] = ("Generate", "GenerateStream"),
    ) -> None:
        self._obs = obs
        self._prefix = f"/{service}/"
        self._generation = frozenset(f"/{service}/{m}" for m in generation_methods)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if (
            handler is None
            or not self._obs.enabled
            or not details.method.startswith(self._prefix)
            or handler.request_streaming
        ):
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not inspect.iscoroutinefunction(behavior):
            return handler
        wrapped = self._wrap(behavior, details.method, details.method in self._generation)
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(self, behavior: Callable, method: str, generation: bool) -> Callable:
        obs = self._obs
        service, _, name = method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            structlog.contextvars.clear_contextvars()
            span = obs.tracer.start_span(
                method.lstrip("/"),
                kind=SpanKind.SERVER,
                attributes=attributes,
                context=extract_context(context.invocation_metadata() or ()),
            )
            token = otel_context.attach(trace.set_span_in_context(span))
            code = grpc.StatusCode.OK
            try:
                with obs.request_scope("grpc", None, span) as rt:
                    try:
                        traceparent = inject_traceparent(span)
                        if traceparent:
                            context.set_trailing_metadata((("traceparent", traceparent),))
                        return await behavior(request, context)
                    except grpc.aio.AbortError:
                        code = context.code() or grpc.StatusCode.UNKNOWN
                        raise
                    except asyncio.CancelledError:
                        code = grpc.StatusCode.CANCELLED
                        raise
                    except BaseException as exc:  # the handler maps errors itself: a bug
                        code = grpc.StatusCode.UNKNOWN
                        rt.fail(exc, "server_error")
                        raise
                    finally:
                        if generation:
                            rt.finish(status_from_grpc(code))
            finally:
                _end_rpc_span(span, code, context)
                otel_context.detach(token)

        return handler


def _end_rpc_span(span: Span, code: grpc.StatusCode, context: Any) -> None:
    try:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            details = context.details() if code is not grpc.StatusCode.CANCELLED else None
            if isinstance(details, bytes):
                details = details.decode("utf-8", "replace")
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))
    except Exception:  # telemetry must never fail a request
        log.exception("rpc span failed")
    finally:
        span.end()
