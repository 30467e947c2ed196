"""The OpenTelemetry GenAI server metrics (semantic conventions, development status), sent
through OTLP when the operator opts in with OTEL_SEMCONV_STABILITY_OPT_IN=
gen_ai_latest_experimental: gen_ai.server.request.duration, gen_ai.server.time_to_first_token
and gen_ai.server.time_per_output_token, histograms in seconds with the conventions'
attributes. They record the same latencies as the Prometheus histograms (whose names do not
change). The OTLP exporter follows the standard variables (OTEL_EXPORTER_OTLP_[METRICS_]
ENDPOINT / _PROTOCOL, OTEL_METRIC_EXPORT_INTERVAL).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

from telemetry.instance import service_resource
from telemetry.tracing import GENAI_PROVIDER

OPT_IN = "gen_ai_latest_experimental"
# the conventions' advised boundaries (seconds)
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip

_lock = threading.Lock()
_provider: MeterProvider | None = None


def opted_in(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether OTEL_SEMCONV_STABILITY_OPT_IN (a comma-separated list) names the GenAI opt-in."""
    values = environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")
    return OPT_IN in {v.strip() for v in values}


def _otlp_reader() -> MetricReader:
    protocol = (
        (
            os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        .strip()
        .lower()
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    else:
        raise ValueError(f"OTLP protocol {protocol!r} unsupported (grpc|http/protobuf)")
    return PeriodicExportingMetricReader(OTLPMetricExporter())


def configure_meter_provider(readers: Sequence[MetricReader] | None = None) -> MeterProvider:
    """The process's MeterProvider for the GenAI metrics, built once (OTLP by default; tests
    pass their own readers before the server builds it); later calls return it."""
    global _provider
    with _lock:
        if _provider is None:
            _provider = MeterProvider(
                metric_readers=list(readers) if readers is not None else [_otlp_reader()],
                resource=service_resource(),
            )
        return _provider


def shutdown_meter_provider(timeout_s: float = 5.0) -> None:
    """Exports what is left (at process exit)."""
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown(timeout_millis=timeout_s * 1e3)


class GenAIServerMetrics:
    def __init__(self, provider: MeterProvider, model: str) -> None:
        meter = provider.get_meter("moeserve")
        self.model = model
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration such as time-to-last byte or "
            "last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for "
            "successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )

    def record(self, latencies: Any, operation: str | None, error_type: str | None) -> None:
        """One finished request's RequestLatencies (telemetry.metrics): its duration always,
        TTFT and TPOT for successful requests (as the conventions say)."""
        attrs: dict[str, str] = {
            "gen_ai.operation.name": operation or "text_completion",
            "gen_ai.provider.name": GENAI_PROVIDER,
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
        }
        if error_type is not None:
            attrs["error.type"] = error_type
        if latencies.e2e is not None:
            self.duration.record(max(latencies.e2e, 0.0), attrs)
        if error_type is None:
            if latencies.ttft is not None:
                self.ttft.record(max(latencies.ttft, 0.0), attrs)
            if latencies.tpot is not None:
                self.tpot.record(max(latencies.tpot, 0.0), attrs)
