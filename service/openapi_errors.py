"""The error responses a route declares for the OpenAPI document, each in OpenAI's error
envelope. Apart from openapi.py so that routes of any package (the inspector's included) can
declare them without importing the document builder, which imports their schemas."""

from __future__ import annotations

from litestar.openapi import ResponseSpec

from service import responses as response_bodies

_DESCRIPTIONS = {
    400: "Invalid request: `error.param` names the field",
    401: "Missing or invalid API key",
    404: "Unknown model",
    413: "Body over the size limit",
    429: "Waiting queue full, or the API key over one of its limits (`code`: "
    "rate_limit_exceeded): retry after the `retry-after` header's seconds",
    503: "Draining after SIGTERM, or the engine is not running",
}


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """A route's error responses, each in OpenAI's error envelope."""
    return {
        s: ResponseSpec(
            response_bodies.ErrorResponse, description=_DESCRIPTIONS[s], generate_examples=False
        )
        for s in statuses
    }
