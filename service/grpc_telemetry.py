"""The SERVER span of every moeserve.v1.Inference RPC: continuing the caller's `traceparent`
metadata, current while the handler runs (the generation methods' requests describe it,
service/generation.py), returned as trailing metadata, and ended with the RPC's status code.

OpenTelemetry's own aio interceptor would iterate a streaming handler with `async for`; ours
write with `context.write` (a coroutine), which it cannot wrap.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from service.observability import Observability
from telemetry.logging import get_logger
from telemetry.tracing import extract_context, inject_traceparent

log = get_logger("service.grpc_telemetry")


class GrpcTelemetryInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, obs: Observability, service: str) -> None:
        self._obs = obs
        self._prefix = f"/{service}/"

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
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            self._wrap(behavior, details.method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(self, behavior: Callable, method: str) -> Callable:
        tracer = self._obs.tracer
        service, _, name = method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            structlog.contextvars.clear_contextvars()
            span = tracer.start_span(
                method.lstrip("/"),
                kind=SpanKind.SERVER,
                attributes=attributes,
                context=extract_context(context.invocation_metadata() or ()),
            )
            token = otel_context.attach(trace.set_span_in_context(span))
            code = grpc.StatusCode.OK
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
            except BaseException:  # the handler maps errors itself: a bug
                code = grpc.StatusCode.UNKNOWN
                raise
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
