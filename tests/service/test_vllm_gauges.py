"""The Gateway API Inference Extension's model-server protocol gauges under vLLM's names
(issue 36): each equals its moeserve_ twin, in both exposition formats, and
vllm:cache_config_info reports the served engine's paged cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from telemetry.metrics import ServiceMetrics, render_metrics

TWINS = {
    "vllm:num_requests_running": "moeserve_num_requests_running",
    "vllm:num_requests_waiting": "moeserve_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "moeserve_kv_cache_usage_ratio",
}
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _by_name(text: str, openmetrics: bool = False) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in (parse_openmetrics if openmetrics else parse_text)(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _step(running: int, waiting: int, kv: float) -> SimpleNamespace:
    return SimpleNamespace(
        duration_s=0.01,
        num_running=running,
        num_waiting=waiting,
        batch_size=running,
        num_prefill_tokens=0,
        num_decode_tokens=running,
        num_generated_tokens=running,
        kv_usage=kv,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        request_ids=[],
        expert_tokens=None,
        finished=[],
    )


@pytest.mark.parametrize("accept", [None, OPENMETRICS])
def test_each_vllm_gauge_equals_its_twin_step_after_step(accept):
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "tiny", 1, 2, 8, kv_cache_blocks=(16, 512))
    for running, waiting, kv in [(3, 2, 0.25), (1, 0, 0.0625), (0, 0, 0.0)]:
        metrics.observe_step(_step(running, waiting, kv))
        body, content_type = render_metrics(registry, accept)
        samples = _by_name(body.decode(), "openmetrics" in content_type)
        for ours, twin in TWINS.items():
            (vllm_sample,), (twin_sample,) = samples[ours], samples[twin]
            assert vllm_sample.value == twin_sample.value, ours
            assert vllm_sample.labels == {"model_name": "tiny", "engine": "0"}
        assert samples["vllm:num_requests_running"][0].value == running
        assert samples["vllm:kv_cache_usage_perc"][0].value == kv
    (info,) = _by_name(render_metrics(registry)[0].decode())["vllm:cache_config_info"]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "512", "engine": "0"}
    assert info.value == 1


def test_the_server_reports_its_cache_under_vllms_names(server, http):
    response = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3})
    assert response.status_code == 200, response.text
    samples = _by_name(http.get("/metrics").text)
    engine = server.state.engine
    (info,) = samples["vllm:cache_config_info"]
    assert int(info.labels["block_size"]) == engine.block_size
    assert int(info.labels["num_gpu_blocks"]) == engine.num_blocks
    assert engine.block_size * engine.num_blocks == engine.kv_cache_tokens
    for ours, twin in TWINS.items():
        (vllm_sample,) = samples[ours]
        (twin_sample,) = samples[twin]
        assert vllm_sample.value == twin_sample.value, ours
        assert vllm_sample.labels["model_name"] == twin_sample.labels["model"]
