"""gRPC API (SPEC section 7): moeserve.v1.Inference on grpc.aio, plus health and reflection.

The servicer (service/grpc_servicer.py) parses and renders; `_wrap` does the rest once per
method: the SERVER span, the API key, the raw request parsed (undecodable: INVALID_ARGUMENT),
the generation methods' service.generation.Generation, exceptions mapped to statuses
(unexpected ones logged, INTERNAL) and the Generation finished with the status sent.

A deadline or a client cancel cancels the handler task; closing the Generation's update
iterator then aborts the request in the engine and frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import grpc
import structlog
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from service import validation
from service.auth import authenticate
from service.errors import BadRequest, Overloaded, ServiceError
from service.generation import Generation
from service.grpc_servicer import SAMPLING_FIELDS, InferenceServicer
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.state import ServingState
from telemetry.metrics import status_from_grpc
from telemetry.tracing import extract_context, inject_traceparent

log = structlog.get_logger("service.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "moeserve.v1.Inference"
MAX_SEND_BYTES = 16 << 20
_GENERATION_METHODS = ("Generate", "GenerateStream")
HEALTH_POLL_S = 0.2


def _status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The one mapping from an exception to (code, details, trailing metadata)."""
    if isinstance(exc, ServiceError):
        message = exc.message
        if isinstance(exc, BadRequest) and exc.param:  # details name the field, as REST's param
            field = exc.param
            if field.split("[")[0] in SAMPLING_FIELDS:
                field = f"params.{field}"  # as the proto spells its path
            if message.startswith(exc.param):
                message = field + message[len(exc.param) :]
            else:
                message = f"{field}: {message}"
        trailing = _retry_info(exc, message) if isinstance(exc, Overloaded) else ()
        return exc.grpc_code, message, trailing
    log.exception("unexpected error in gRPC handler", method=method)
    return grpc.StatusCode.INTERNAL, "internal server error", ()


def _retry_info(exc: Overloaded, message: str) -> tuple:
    """When to retry, twice: `retry-after` (seconds, as REST's header) and the standard
    google.rpc.RetryInfo in the status details (grpcio-status' rpc_status.from_call reads it)."""
    info = AnyProto()
    info.Pack(error_details_pb2.RetryInfo(retry_delay=Duration(seconds=exc.retry_after_s)))
    status = status_pb2.Status(code=exc.grpc_code.value[0], message=message, details=[info])
    return (
        ("retry-after", str(exc.retry_after_s)),
        *rpc_status.to_status(status).trailing_metadata,
    )


def _open_span(state: ServingState, method: str, context: grpc.aio.ServicerContext) -> Span:
    """The RPC's SERVER span, continuing the caller's `traceparent` metadata and returned as
    trailing metadata (OpenTelemetry's aio interceptor would iterate a streaming handler with
    `async for`; ours write with `context.write`, which it cannot wrap)."""
    obs = state.observability
    if not obs.enabled:
        return INVALID_SPAN
    span = obs.tracer.start_span(
        f"{SERVICE_NAME}/{method}",
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method},
        context=extract_context(context.invocation_metadata() or ()),
    )
    traceparent = inject_traceparent(span)
    if traceparent:
        context.set_trailing_metadata((("traceparent", traceparent),))
    return span


def _end_span(span: Span, code: grpc.StatusCode, details: str) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}".rstrip(": ")))
    span.end()


def _authenticate(state: ServingState, context: grpc.aio.ServicerContext, gen: Generation | None):
    """`authorization: Bearer KEY` metadata, checked as REST checks the header."""
    given = dict(context.invocation_metadata() or ()).get("authorization")
    caller = authenticate(
        state.keys,
        given if isinstance(given, str) else None,
        "metadata 'authorization: Bearer KEY'",
    )
    if gen is not None:
        gen.authenticated(caller)


def _wrap(state: ServingState, method: str, fn: Callable, request_type) -> Callable:
    """One wrapper per RPC: the server span, the API key, the raw request parsed, the method
    run (with its Generation for the generation methods), exceptions turned into statuses and
    the Generation finished with the status sent; cancellation propagates."""
    generation = method in _GENERATION_METHODS

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        structlog.contextvars.clear_contextvars()
        span = _open_span(state, method, context)
        token = otel_context.attach(trace.set_span_in_context(span))
        gen = Generation(state, "grpc", uuid.uuid4().hex, span) if generation else None
        code, details, trailing = grpc.StatusCode.OK, "", ()
        try:
            _authenticate(state, context, gen)
            try:
                request = request_type.FromString(raw)
            except DecodeError as exc:
                raise BadRequest(
                    f"cannot decode {request_type.DESCRIPTOR.full_name}: {exc}"
                ) from None
            if gen is None:
                return await fn(request, context)
            rid = validation.request_id(request.request_id or None, fresh_prefix="grpc-")
            gen.identify(rid, response_id=rid)
            structlog.contextvars.bind_contextvars(request_id=gen.request_id)
            return await fn(request, context, gen)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 -- mapped to a status right below
            code, details, trailing = _status(exc, method)
            if gen is not None:
                gen.fail(exc)
            if trailing:  # abort() replaces the trailing metadata set so far (traceparent)
                trailing = (*(context.trailing_metadata() or ()), *trailing)
        finally:
            if gen is not None:
                gen.finish(status_from_grpc(code), code.name)
            if state.observability.api_requests is not None:
                state.observability.api_requests.count_grpc(method, code.name)
            _end_span(span, code, details)
            otel_context.detach(token)
        if not context.done():
            await context.abort(code, details, trailing)

    return handler


def _inference_handler(state: ServingState) -> grpc.GenericRpcHandler:
    """Registers moeserve.v1.Inference with raw-bytes requests (parsed inside `_wrap`)."""
    servicer = InferenceServicer(state)
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        request_type = getattr(pb, m.input_type.name)
        response_type = getattr(pb, m.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(
            _wrap(state, m.name, getattr(servicer, m.name), request_type),
            request_deserializer=None,
            response_serializer=response_type.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class ServingHealth(HealthServicer):
    """grpc.health.v1.Health following `state.ready` (services "" and moeserve.v1.Inference):
    NOT_SERVING while the engine is not running or the server drains. Check reads the state
    live; Watch streams follow a HEALTH_POLL_S poll. Once draining it stays NOT_SERVING."""

    def __init__(self, state: ServingState, services: tuple[str, ...]) -> None:
        super().__init__()
        self._state, self._services = state, services

    async def sync(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self._state.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != serving and not self._gracefully_shutting_down and self._state.draining:
            await self.enter_graceful_shutdown()  # draining is for good
        for service in self._services:
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request, context):
        await self.sync()
        return await super().Check(request, context)

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self.sync()
            except Exception:  # health reporting must outlive a bad sync
                log.exception("gRPC health sync failed")


class GrpcServer:
    """moeserve.v1.Inference with health and reflection on one grpc.aio server, from `start`
    to `stop`; `port` is the bound one (0 asked for a free port)."""

    def __init__(self, server: grpc.aio.Server, health: ServingHealth, port: int) -> None:
        self.server, self.health, self.port = server, health, port
        self._poller = asyncio.get_running_loop().create_task(health.poll())

    @classmethod
    async def start(
        cls,
        state: ServingState,
        host: str,
        port: int,
        credentials: grpc.ServerCredentials | None = None,
    ) -> GrpcServer:
        """Binds `host:port`, over TLS with `credentials` (service/tls.py), and serves."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", state.settings.max_body_bytes),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
            ],
        )
        server.add_generic_rpc_handlers((_inference_handler(state),))
        health = ServingHealth(state, ("", SERVICE_NAME))
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        services = (SERVICE_NAME, health_service, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, server)
        address = (
            f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        )
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind the gRPC server to {address}: {exc}") from None
        if not bound:
            raise RuntimeError(f"cannot bind the gRPC server to {address}")
        await health.sync()
        await server.start()
        log.info(
            "grpc server started", grpc_host=host, grpc_port=bound, tls=credentials is not None
        )
        return cls(server, health, bound)

    async def mark_not_serving(self) -> None:
        """Health turns NOT_SERVING now and stays so (graceful shutdown has begun)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        """Reports NOT_SERVING, then stops: in-flight RPCs get `grace` seconds, new ones are
        refused."""
        await self.mark_not_serving()
        self._poller.cancel()
        await self.server.stop(grace)
        log.info("grpc server stopped")
