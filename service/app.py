"""The Litestar application: controllers, the OpenAI error envelope, request ids."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import structlog
from litestar import Litestar, Request, Response
from litestar.datastructures import State
from litestar.exceptions import HTTPException, InternalServerException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin
from litestar.types import Message, Scope
from opentelemetry import trace
from opentelemetry.util.http import (
    OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS,
    get_custom_headers,
)

from service import validation
from service.auth import SECRET_HEADERS
from service.controllers.common import (
    REQUEST_ID_HEADER,
    ClientClosedRequest,
    bind_request_id,
    record_error,
    request_id,
)
from service.controllers.openai import OpenAIController
from service.controllers.probes import ProbesController
from service.controllers.render import RenderController
from service.controllers.tokenize import TokenizeController
from service.errors import Overloaded, ServiceError
from service.inspector.controller import inspector_routes
from service.openapi import TruthfulOpenAPI
from service.responses import ErrorBody, ErrorResponse
from service.state import ServingState
from telemetry.tracing import inject_traceparent

log = structlog.get_logger("service.app")

# (error type, code) of the HTTP errors Litestar raises itself; ours are ServiceErrors
_HTTP_ERRORS = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


# what Litestar raises (as a 500) when the client hangs up before its body is in
_CLIENT_GONE = "client disconnected prematurely"


class _Request(Request):
    async def body(self) -> bytes:
        """The body; a client that leaves before sending all of it ends the request as a
        client error (499), as one leaving before its answer does, not as a server error."""
        try:
            return await super().body()
        except InternalServerException as exc:
            if exc.detail == _CLIENT_GONE:
                raise ClientClosedRequest("the client closed the connection mid-body") from exc
            raise

    async def json(self) -> Any:
        """The body decoded once, strictly, into the route's schema (validation.decode_body);
        Litestar's own decoding coerces ("5" -> 5) and lets deep nesting crash."""
        field = self.route_handler.parsed_data_field
        if field is None or not isinstance(field.annotation, type):
            return await super().json()
        return validation.decode_body(await self.body(), field.annotation)


def error_response(request: Request, exc: Exception) -> Response[ErrorResponse]:
    """Every error leaves in OpenAI's envelope; unexpected ones are logged and become 500."""
    headers: dict[str, str] = {}
    if isinstance(exc, ServiceError):
        status, body = exc.status_code, exc.envelope()
        if isinstance(exc, Overloaded):
            headers["retry-after"] = str(exc.retry_after_s)
    elif isinstance(exc, HTTPException):
        status = exc.status_code
        message = exc.detail
        if status == 413:
            limit = request.app.state.serving.settings.max_body_bytes
            message = f"request body exceeds the limit of {limit} bytes"
        default = ("invalid_request_error" if status < 500 else "server_error", None)
        kind, code = _HTTP_ERRORS.get(status, default)
        body = ErrorResponse(error=ErrorBody(message=message, type=kind, code=code))
        headers.update({k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"})
    else:
        log.exception(
            "unhandled error", path=request.url.path, request_id=request_id(request.scope)
        )
        body = ErrorResponse(error=ErrorBody(message="internal server error", type="server_error"))
        status = 500
    record_error(request.scope, exc)
    return Response(body, status_code=status, headers=headers)


async def _add_request_id(message: Message, scope: Scope) -> None:
    """Puts `x-request-id` on every response, errors and 404s included, and `traceparent`
    (the server span's) on every traced one."""
    if message["type"] == "http.response.start":
        headers = list(message.get("headers") or [])
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((REQUEST_ID_HEADER.encode(), request_id(scope).encode()))
        traceparent = inject_traceparent(trace.get_current_span())
        if traceparent is not None:
            headers.append((b"traceparent", traceparent.encode()))
        message["headers"] = headers


async def _count_api_request(message: Message, scope: Scope) -> None:
    """moeserve_api_requests_total: each API route's response by its status (errors too:
    this sees what the exception handlers send)."""
    if message["type"] == "http.response.start":
        counter = scope["app"].state.serving.observability.api_requests
        if counter is not None:
            counter.count_rest(scope.get("path", ""), message["status"])


# Probes, scrapes, the schema and the inspector (its page polls) get no spans (Prometheus
# alone would send one a second).
_UNTRACED_PATHS = ["^/health$", "^/ready$", "^/metrics$", "^/schema", "^/inspect"]


def _span_details(scope: Scope) -> tuple[str, dict[str, str]]:
    """Server span name "METHOD /route" and `http.route` for the app's own routes only, so a
    stray URL cannot mint new span names (Litestar's default puts "METHOD /path" in
    http.route)."""
    method = str(scope.get("method") or "HTTP")
    path = scope.get("path", "")
    if any(route.path == path for route in scope["app"].routes):
        return f"{method} {path}", {"http.route": path}
    return method, {}


def _telemetry_config(state: ServingState) -> dict:
    """Litestar's OpenTelemetryPlugin opens each request's SERVER span (continuing an incoming
    `traceparent`; current while the request is handled); generation requests name it after
    their GenAI operation and add their attributes and phases (service/generation.py).
    Every request binds its request_id for the log lines written while it is served."""
    obs = state.observability
    if not obs.enabled:
        return {}
    config = OpenTelemetryConfig(
        tracer_provider=obs.tracer_provider,
        exclude=_UNTRACED_PATHS,
        exclude_spans=["receive", "send"],
        scope_span_details_extractor=_span_details,
        # headers an operator asks to capture (OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*)
        # go on the span, except the credentials: their values become "[REDACTED]"
        http_capture_headers_sanitize_fields=[
            *get_custom_headers(OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS),
            *SECRET_HEADERS,
        ],
    )
    return {"plugins": [OpenTelemetryPlugin(config)], "middleware": [bind_request_id]}


def create_app(state: ServingState) -> Litestar:
    tokenizer = state.engine.tokenizer
    token_text = lru_cache(maxsize=65536)(
        lambda t: tokenizer.decode([t], skip_special_tokens=False)
    )
    inspector = inspector_routes() if state.inspector is not None else []
    return Litestar(
        route_handlers=[
            OpenAIController,
            RenderController,
            TokenizeController,
            ProbesController,
            *inspector,
        ],
        state=State({"serving": state, "started_at": int(time.time()), "token_text": token_text}),
        request_class=_Request,
        exception_handlers={Exception: error_response},
        before_send=[_add_request_id, _count_api_request],
        request_max_body_size=state.settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="moeserve",
            version="0.1.0",
            path="/schema",
            render_plugins=[TruthfulOpenAPI(), SwaggerRenderPlugin()],
        ),
        debug=False,
        logging_config=None,  # logging is configured once for the process, not by the app
        **_telemetry_config(state),
    )
