"""Under OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental a server records the OTel
GenAI server metrics (here into an in-memory reader instead of OTLP) with the same values as
its Prometheus histograms, whose names stay as they are."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from telemetry.genai_metrics import configure_meter_provider, shutdown_meter_provider
from tests.telemetry.test_genai_metrics import points


@pytest.fixture
def reader(monkeypatch):
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http,gen_ai_latest_experimental")
    shutdown_meter_provider()  # none built yet in this process, normally
    reader = InMemoryMetricReader()
    configure_meter_provider([reader])  # the server's build_observability takes this one
    yield reader
    shutdown_meter_provider()


def test_a_request_reaches_the_genai_metrics_and_prometheus_alike(reader, start_server):
    with start_server() as srv:
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        registry, model = srv.state.observability.metrics.registry, srv.state.model_name
        labels = {"model": model, "api": "rest"}
        prometheus = {
            name: registry.get_sample_value(f"moeserve_{name}_seconds_sum", labels)
            for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency")
        }
    got = points(reader)
    (ttft,) = got["gen_ai.server.time_to_first_token"]
    (tpot,) = got["gen_ai.server.time_per_output_token"]
    (duration,) = got["gen_ai.server.request.duration"]
    assert ttft.sum == pytest.approx(prometheus["time_to_first_token"], rel=1e-9)
    assert tpot.sum == pytest.approx(prometheus["time_per_output_token"], rel=1e-9)
    assert duration.sum == pytest.approx(prometheus["e2e_request_latency"], rel=1e-9)
    assert duration.attributes["gen_ai.operation.name"] == "text_completion"
    assert duration.attributes["gen_ai.request.model"] == model
