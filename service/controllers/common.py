"""What the REST routes share: the request id, the serving state, each generation request's
service.generation.Generation (opened before the body is read, finished with the HTTP status
as the last body message goes out), and cancellation on client disconnect."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc
from litestar import Request
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import trace

from service import validation
from service.auth import CALLER_SCOPE_KEY
from service.errors import BadRequest, ServiceError
from service.generation import Generation
from service.state import ServingState
from telemetry.logging import bind_request_context
from telemetry.metrics import status_from_http

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_KEY = "moeserve.request_id"
_GENERATION_KEY = "moeserve.generation"


class ClientClosedRequest(ServiceError):
    """The client went away before the response was ready (nginx's 499); nothing is sent."""

    status_code, grpc_code, error_type = 499, grpc.StatusCode.CANCELLED, "client_closed_request"


def _header(scope: Scope, name: bytes) -> str | None:
    value = next((v for k, v in scope.get("headers", ()) if k == name), None)
    return None if value is None else value.decode("latin-1")


def request_id(scope: Scope) -> str:
    """The request's id for logs and the `x-request-id` response header: the caller's when
    well-formed (validation.request_id), else a fresh one (generation requests refuse a
    malformed one, see generation_lifecycle). Computed once and kept in the ASGI scope."""
    rid = scope.get(_REQUEST_ID_KEY)
    if rid is None:
        try:
            rid = validation.request_id(_header(scope, b"x-request-id"))
        except BadRequest:
            rid = uuid.uuid4().hex
        scope[_REQUEST_ID_KEY] = rid  # type: ignore[literal-required]
    return rid


def bind_request_id(app: ASGIApp) -> ASGIApp:
    """App middleware: every line logged while a request is served carries its request_id
    (trace ids come from the current span, see telemetry.logging)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            bind_request_context(request_id(scope))
        await app(scope, receive, send)

    return middleware


def generation_lifecycle(prefix: str):
    """Route middleware of a generation route: opens the request's Generation (`prefix` of its
    response id) before the body is parsed, so that a refused body counts as the request's
    outcome too, and finishes it with the HTTP status just before the last body message
    goes out (the OTel ASGI middleware ends the server span on that message)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            state: ServingState = scope["app"].state.serving
            gen = Generation(
                state,
                "rest",
                request_id(scope),
                trace.get_current_span(),
                response_id=f"{prefix}-{uuid.uuid4().hex}",
            )
            scope[_GENERATION_KEY] = gen  # type: ignore[literal-required]
            status_code = 500

            async def send_and_finish(message: Message) -> None:
                nonlocal status_code
                if message["type"] == "http.response.start":
                    status_code = message["status"]
                elif message["type"] == "http.response.body" and not message.get("more_body"):
                    gen.finish(status_from_http(status_code), str(status_code))
                await send(message)

            try:
                validation.request_id(_header(scope, b"x-request-id"))  # malformed: 400, as on gRPC
                await app(scope, receive, send_and_finish)
            except ServiceError as exc:
                gen.fail(exc)
                raise
            except asyncio.CancelledError:
                status_code = 499
                raise
            finally:
                gen.finish(status_from_http(status_code), str(status_code))

        return middleware

    return wrap


def generation(request: Request) -> Generation:
    """The request's Generation, run as the caller whose key the API key guard accepted (its
    key's limits, its name in the metrics, the logs and the scheduler's turns)."""
    gen: Generation = request.scope[_GENERATION_KEY]  # type: ignore[literal-required]
    caller = request.scope.get(CALLER_SCOPE_KEY)
    if caller is not None:
        gen.authenticated(caller)
    return gen


def record_error(scope: Scope, exc: BaseException) -> None:
    """An error a request is answered with: on its Generation, or on the server span for
    the other routes."""
    gen = scope.get(_GENERATION_KEY)
    if gen is not None:
        gen.fail(exc)
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Runs `awaitable` but cancels it when the client disconnects first (vLLM's
    @with_cancellation): the generation it drives is then aborted in the engine."""
    work: asyncio.Future[Any] = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientClosedRequest("client closed the connection", code="client_disconnected")
    return work.result()
