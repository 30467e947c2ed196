"""Per-stage latency histograms (queue, prefill, decode) and the context-length histogram,
observed from a finished request's timestamps and token counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from telemetry.metrics import ServiceMetrics


def test_a_finished_request_observes_its_stages_and_context_length():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "m", num_layers=1, num_experts=2, max_waiting=4)
    times = SimpleNamespace(
        arrival=10.0, first_scheduled=10.25, first_token=10.75, last_token=12.0, finished=12.0
    )
    metrics.observe_request("rest", times, 100, 20, "stop")

    def value(name, **labels):
        return registry.get_sample_value(name, {"model": "m", **labels})

    assert value("moeserve_request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value("moeserve_request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value("moeserve_request_decode_time_seconds_sum") == pytest.approx(1.25)
    assert value("moeserve_request_context_tokens_sum", kind="prompt") == 100
    assert value("moeserve_request_context_tokens_sum", kind="total") == 120
    assert value("moeserve_request_context_tokens_bucket", kind="prompt", le="64.0") == 0
    assert value("moeserve_request_context_tokens_bucket", kind="prompt", le="128.0") == 1


def test_a_request_aborted_while_queued_has_no_prefill_or_decode():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "m", num_layers=1, num_experts=2, max_waiting=4)
    times = SimpleNamespace(
        arrival=1.0, first_scheduled=None, first_token=None, last_token=None, finished=2.0
    )
    metrics.observe_request("grpc", times, 7, 0, "abort")
    count = lambda n: registry.get_sample_value(n + "_count", {"model": "m"})
    assert count("moeserve_request_prefill_time_seconds") == 0
    assert count("moeserve_request_decode_time_seconds") == 0
    assert (
        registry.get_sample_value(
            "moeserve_request_context_tokens_count", {"model": "m", "kind": "prompt"}
        )
        == 1
    )
