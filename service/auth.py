"""Guards for the API routes: the API key (service/api_keys.py) and refusing new work while
draining; the same key check for gRPC metadata.

/health, /ready and /metrics carry neither guard, so probes and scrapes keep working.
"""

from __future__ import annotations

import structlog
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from opentelemetry import trace

from service.api_keys import Caller, KeyRing
from service.errors import Unauthorized, Unavailable

# never recorded on a span, even when OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_* asks for them
SECRET_HEADERS = ("authorization", "proxy-authorization")
SPAN_ATTRIBUTE = "moeserve.key"  # the key's name on the request's server span
CALLER_SCOPE_KEY = "moeserve.caller"  # the REST request's Caller, in its ASGI scope


def authenticate(keys: KeyRing, authorization: str | None, how: str) -> Caller:
    """The caller a request's Authorization header (or gRPC metadata) names, or Unauthorized
    (`how`: where the key goes). The caller's name goes on the current span and on every log
    line written for the request from here on."""
    caller = keys.authenticate(authorization)
    if caller is None:
        raise Unauthorized(f"invalid or missing API key (expected {how})", code="invalid_api_key")
    structlog.contextvars.bind_contextvars(key=caller.name)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(SPAN_ATTRIBUTE, caller.name)
    return caller


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    keys = connection.app.state.serving.keys
    connection.scope[CALLER_SCOPE_KEY] = authenticate(  # type: ignore[literal-required]
        keys, connection.headers.get("authorization"), "'Authorization: Bearer <key>'"
    )


def reject_while_draining(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if connection.app.state.serving.draining:
        raise Unavailable("server is shutting down", code="draining")
