"""In-process OTLP trace receiver for tests: a gRPC TraceService (and an HTTP /v1/traces
endpoint) on free 127.0.0.1 ports, collecting exported spans in memory.

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)  # grpc
        ...
        spans = receiver.wait_for_spans(lambda s: s.name == "decode")

`receiver.http_endpoint` is the full URL for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, "" for a root
    kind: int
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time_unix_ns, attributes)
    links: list[tuple[str, str]]  # (trace_id, span_id)
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def service_name(self) -> str | None:
        return self.resource.get("service.name")


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attrs(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_unix_ns=s.start_time_unix_nano,
                        end_unix_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status_code=s.status.code,
                        resource=resource,
                    )
                )
    return out


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):
        self._receiver._collect(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Collects spans sent over OTLP/gRPC (`endpoint`) and OTLP/HTTP (`http_endpoint`)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.requests: list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]] = []
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._grpc_server: grpc.Server | None = None
        self._http_server: ThreadingHTTPServer | None = None
        self.port = 0
        self.http_port = 0

    # -------------------------------------------------------------- lifecycle

    def start(self) -> OtlpReceiver:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        self.port = server.add_insecure_port(f"{self.host}:0")
        server.start()
        self._grpc_server = server

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._collect(request, "http")
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        self._http_server = ThreadingHTTPServer((self.host, 0), Handler)
        self.http_port = self._http_server.server_address[1]
        threading.Thread(
            target=self._http_server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-http-receiver",
            daemon=True,
        ).start()
        return self

    def stop(self) -> None:
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None)
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT with the grpc protocol."""
        return f"http://{self.host}:{self.port}"

    @property
    def http_endpoint(self) -> str:
        """Full URL for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT with http/protobuf."""
        return f"http://{self.host}:{self.http_port}/v1/traces"

    # -------------------------------------------------------------- collected data

    def _collect(self, request: trace_service_pb2.ExportTraceServiceRequest, via: str) -> None:
        spans = _spans(request)
        with self._cond:
            self.requests.append((via, request))
            self._spans.extend(spans)
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self.requests.clear()

    def wait_for_spans(
        self,
        predicate: Callable[[ReceivedSpan], bool] = lambda span: True,
        count: int = 1,
        timeout: float = 10.0,
    ) -> list[ReceivedSpan]:
        """Block until at least `count` received spans match; returns all that match.
        Raises TimeoutError with what did arrive otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                matched = [s for s in self._spans if predicate(s)]
                if len(matched) >= count:
                    return matched
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise TimeoutError(
                        f"{len(matched)}/{count} matching spans after {timeout}s; got {names}"
                    )
                self._cond.wait(left)
