"""Service errors, each mapped once to an HTTP status (OpenAI error envelope) and a gRPC code."""

from __future__ import annotations

import asyncio

import grpc
from litestar.exceptions import HTTPException

from inference import EngineDeadError, InvalidParameterError, QueueFullError
from service.responses import ErrorBody, ErrorResponse
from telemetry.metrics import status_from_http


class ServiceError(Exception):
    status_code = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def envelope(self) -> ErrorResponse:
        """The error as OpenAI's error body."""
        body = ErrorBody(
            message=self.message, type=self.error_type, param=self.param, code=self.code
        )
        return ErrorResponse(error=body)


class BadRequest(ServiceError):
    status_code, error_type = 400, "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthorized(ServiceError):
    status_code, error_type = 401, "authentication_error"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(ServiceError):
    status_code, grpc_code, error_type = 404, grpc.StatusCode.NOT_FOUND, "not_found_error"


class Overloaded(ServiceError):
    """Waiting queue full: shed load, tell the client when to retry."""

    status_code, grpc_code, error_type = 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error"
    retry_after_s = 1


class RateLimited(Overloaded):
    """An API key over one of its limits (service/rate_limits.py); `limit` names it."""

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.limit, self.retry_after_s = limit, retry_after_s


class Unavailable(ServiceError):
    """Draining after SIGTERM, or the engine is not running."""

    status_code, grpc_code, error_type = 503, grpc.StatusCode.UNAVAILABLE, "service_unavailable"


def from_engine_error(exc: Exception, constraint_field: str | None = None) -> ServiceError:
    """Maps the engine's exceptions onto service errors (anything else stays unexpected); an
    error in the grammar constraint names `constraint_field`, the API's field it came from."""
    if isinstance(exc, InvalidParameterError):
        param = exc.param
        if constraint_field and param.startswith("structured_outputs"):
            return BadRequest(f"{constraint_field}: {exc.message}", param=constraint_field)
        return BadRequest(str(exc), param=param)
    if isinstance(exc, QueueFullError):
        return Overloaded(str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return Unavailable(str(exc), code="engine_dead")
    raise TypeError(f"not an engine error: {exc!r}")


ENGINE_ERRORS = (InvalidParameterError, QueueFullError, EngineDeadError)


def status_of(exc: BaseException) -> str:
    """The requests_total status of an exception a request ends with: its HTTP status for
    ours and for Litestar's own (a body over the limit is a 413, an empty one a 400: the
    client's error, not the server's)."""
    if isinstance(exc, (ServiceError, HTTPException)):
        return status_from_http(exc.status_code)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "client_error"  # the caller went away (disconnect, cancel, deadline)
    return "server_error"
