"""Guards for the API routes: bearer-token auth and refusing new work while draining.

/health, /ready and /metrics carry neither guard, so probes and scrapes keep working.
"""

from __future__ import annotations

import hashlib
import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from service.errors import Unauthorized, Unavailable


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def check_bearer(authorization: str | None, api_key: str | None) -> bool:
    """True when no key is configured or `authorization` is `Bearer <api_key>`. Compares
    SHA-256 digests in constant time, so neither content nor length leaks through timing."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    ok = hmac.compare_digest(_digest(token.strip()), _digest(api_key))
    return ok and scheme.lower() == "bearer"


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    api_key = connection.app.state.serving.settings.api_key
    if not check_bearer(connection.headers.get("authorization"), api_key):
        raise Unauthorized(
            "invalid or missing API key (expected 'Authorization: Bearer <key>')",
            code="invalid_api_key",
        )


def reject_while_draining(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if connection.app.state.serving.draining:
        raise Unavailable("server is shutting down", code="draining")
