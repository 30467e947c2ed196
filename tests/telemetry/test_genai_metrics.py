"""The OTel GenAI server metrics: the opt-in, and what a finished request records."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from telemetry.genai_metrics import GenAIServerMetrics, opted_in
from telemetry.metrics import RequestLatencies


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                assert m.unit == "s", m.name
                out[m.name] = list(m.data.data_points)
    return out


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("gen_ai_latest_experimental", True),
        ("http, gen_ai_latest_experimental", True),
        ("http", False),
        ("", False),
    ],
)
def test_opt_in(value, expected):
    assert opted_in({"OTEL_SEMCONV_STABILITY_OPT_IN": value}) is expected


def test_a_request_records_duration_ttft_and_tpot_with_genai_attributes():
    reader = InMemoryMetricReader()
    metrics = GenAIServerMetrics(MeterProvider(metric_readers=[reader]), "demo")
    metrics.record(RequestLatencies(0.01, 0.25, 0.05, 1.5), "chat", None)
    metrics.record(RequestLatencies(None, None, None, 0.5), "text_completion", "BadRequest")
    got = points(reader)
    (ttft,) = got["gen_ai.server.time_to_first_token"]
    (tpot,) = got["gen_ai.server.time_per_output_token"]
    assert (ttft.sum, ttft.count) == (0.25, 1) and (tpot.sum, tpot.count) == (0.05, 1)
    assert ttft.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "moeserve",
        "gen_ai.request.model": "demo",
        "gen_ai.response.model": "demo",
    }
    durations = {p.attributes.get("error.type"): p for p in got["gen_ai.server.request.duration"]}
    assert durations[None].sum == 1.5 and durations["BadRequest"].sum == 0.5
    assert durations["BadRequest"].attributes["gen_ai.operation.name"] == "text_completion"


def test_they_leave_through_otlp(monkeypatch):
    """The default reader: OTLP over HTTP/protobuf to the configured endpoint, flushed at
    shutdown (as at process exit)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

    from telemetry.genai_metrics import configure_meter_provider, shutdown_meter_provider

    received: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{http.server_port}/v1/metrics"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
    shutdown_meter_provider()
    try:
        metrics = GenAIServerMetrics(configure_meter_provider(), "demo")
        metrics.record(RequestLatencies(0.0, 0.125, 0.01, 0.5), "chat", None)
    finally:
        shutdown_meter_provider()
        http.shutdown()
    names = {
        m.name
        for request in received
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    } <= names
