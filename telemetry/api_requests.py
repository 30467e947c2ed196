"""Requests by type and answer, as SGLang's users ask for them (SPEC section 13 issue 37):
moeserve_api_requests_total{model, api, request_type, http_status, grpc_code}.

request_type is the REST route's kind (completion, chat, tokenize, detokenize, models, and
vLLM's render routes completion_render and chat_render, which vLLM's router under kv_aware
calls on every replica for each request it routes) or
the gRPC method (Generate, GenerateStream, Tokenize, ModelInfo); http_status the status sent
(REST; "" on gRPC, which Prometheus shows as no label), grpc_code the status code's name
(gRPC; "" on REST). Every value comes from a fixed set: statuses outside KNOWN_HTTP become
their class ("2xx".."5xx"), routes outside REST_TYPES are not counted. moeserve_requests_total
keeps its labels and meaning (generation requests by outcome and key).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

REST_TYPES = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/models": "models",
    "/v1/completions/render": "completion_render",
    "/v1/chat/completions/render": "chat_render",
}
GRPC_METHODS = ("Generate", "GenerateStream", "Tokenize", "ModelInfo")
KNOWN_HTTP = frozenset(
    (200, 400, 401, 403, 404, 405, 408, 413, 415, 422, 429, 499, 500, 501, 503, 504)
)
GRPC_CODES = frozenset((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
))  # fmt: skip


def http_status_label(status: int) -> str:
    return str(status) if status in KNOWN_HTTP else f"{status // 100}xx"


class ApiRequests:
    """The counter; REST and gRPC series of every request type exported from start-up (at 0
    for their success status)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        self.counter = Counter(
            "moeserve_api_requests",
            "API requests by type (REST route kind or gRPC method) and the HTTP status or gRPC "
            "code answered.",
            ("model", "api", "request_type", "http_status", "grpc_code"),
            registry=registry,
        )
        for kind in REST_TYPES.values():
            self.counter.labels(model, "rest", kind, "200", "")
        for method in GRPC_METHODS:
            self.counter.labels(model, "grpc", method, "", "OK")

    def count_rest(self, path: str, status: int) -> None:
        """A REST response's status; paths that are no API route are not counted."""
        kind = REST_TYPES.get(path)
        if kind is not None:
            self.counter.labels(self.model, "rest", kind, http_status_label(status), "").inc()

    def count_grpc(self, method: str, code: str) -> None:
        """A gRPC call's status code name (grpc.StatusCode.name)."""
        if method in GRPC_METHODS:
            code = code if code in GRPC_CODES else "UNKNOWN"
            self.counter.labels(self.model, "grpc", method, "", code).inc()
