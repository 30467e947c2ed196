from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from telemetry.metrics import (
    FINISH_REASONS,
    STATUSES,
    STRUCTURED_KINDS,
    ServiceMetrics,
    render_metrics,
    request_latencies,
    status_from_grpc,
    status_from_http,
)

SPEC_METRICS = {  # SPEC section 8 (+ max_waiting for the alert rules): name -> type
    "moeserve_time_to_first_token_seconds": "histogram",
    "moeserve_time_per_output_token_seconds": "histogram",
    "moeserve_e2e_request_latency_seconds": "histogram",
    "moeserve_request_queue_time_seconds": "histogram",
    "moeserve_prompt_tokens": "counter",
    "moeserve_generation_tokens": "counter",
    "moeserve_requests": "counter",
    "moeserve_num_requests_running": "gauge",
    "moeserve_num_requests_waiting": "gauge",
    "moeserve_kv_cache_usage_ratio": "gauge",
    "moeserve_batch_size": "histogram",
    "moeserve_engine_step_seconds": "histogram",
    "moeserve_preemptions": "counter",
    "moeserve_moe_expert_tokens": "counter",
    "moeserve_moe_expert_imbalance": "gauge",
    "moeserve_max_waiting": "gauge",
    # SPEC section 12 (structured outputs)
    "moeserve_structured_requests": "counter",
    "moeserve_grammar_compile_seconds": "histogram",
}
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def metrics(registry):
    return ServiceMetrics(registry, "tiny-moe", num_layers=2, num_experts=4, max_waiting=64)


def _times(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=13.0):
    return SimpleNamespace(
        arrival=arrival,
        first_scheduled=first_scheduled,
        first_token=first_token,
        last_token=finished,
        finished=finished,
        num_preemptions=0,
    )


def _step(expert_tokens=None, **kw):
    base = {
        "started": 0.0,
        "started_unix_ns": 0,
        "duration_s": 0.02,
        "num_running": 3,
        "num_waiting": 2,
        "batch_size": 3,
        "num_prefill_tokens": 10,
        "num_decode_tokens": 2,
        "num_generated_tokens": 3,
        "kv_usage": 0.25,
        "num_preemptions": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "request_ids": ["a", "b", "c"],
        "expert_tokens": expert_tokens,
        "finished": [],
    }
    base.update(kw)
    return SimpleNamespace(**base)


def _families(registry, accept=None):
    body, content_type = render_metrics(registry, accept)
    parse = parse_openmetrics if "openmetrics" in content_type else parse_text
    return {f.name: f for f in parse(body.decode())}, body.decode(), content_type


def _value(families, family, sample_name, **labels):
    for sample in families[family].samples:
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError((sample_name, labels))


def test_every_spec_metric_is_exported_at_start_up(metrics, registry):
    families, _text, content_type = _families(registry)
    assert content_type.startswith("text/plain")
    for name, kind in SPEC_METRICS.items():
        assert name in families, name
        assert families[name].type == kind
        assert families[name].samples, f"{name} has no series at start-up"
    requests = [
        s for s in families["moeserve_requests"].samples if s.name == "moeserve_requests_total"
    ]
    assert len(requests) == 2 * len(STATUSES) * len(FINISH_REASONS)
    assert all(s.value == 0 and s.labels["model"] == "tiny-moe" for s in requests)
    experts = {
        (s.labels["layer"], s.labels["expert"])
        for s in families["moeserve_moe_expert_tokens"].samples
        if s.name.endswith("_total")
    }
    assert experts == {(str(layer), str(e)) for layer in range(2) for e in range(4)}
    for api in ("rest", "grpc"):
        assert (
            _value(
                families,
                "moeserve_time_to_first_token_seconds",
                "moeserve_time_to_first_token_seconds_count",
                api=api,
            )
            == 0
        )
    assert _value(families, "moeserve_max_waiting", "moeserve_max_waiting") == 64


def test_request_latencies():
    lat = request_latencies(_times(), num_output_tokens=5)
    assert lat.queue == pytest.approx(0.5)
    assert lat.ttft == pytest.approx(1.0)
    assert lat.e2e == pytest.approx(3.0)
    assert lat.tpot == pytest.approx((3.0 - 1.0) / 4)
    assert lat.log_fields() == {
        "queue_ms": 500.0,
        "ttft_ms": 1000.0,
        "tpot_ms": 500.0,
        "e2e_ms": 3000.0,
    }
    assert request_latencies(_times(), num_output_tokens=1).tpot is None
    never_ran = request_latencies(_times(first_scheduled=None, first_token=None), 0)
    assert (never_ran.queue, never_ran.ttft, never_ran.tpot) == (None, None, None)


def test_observe_request(metrics, registry):
    lat = metrics.observe_request("grpc", _times(), 7, 5, "stop", "ok", TRACE_ID)
    assert lat.tpot == pytest.approx(0.5)
    metrics.observe_request("rest", _times(), 3, 0, "abort", "ok", None)
    families, _, _ = _families(registry)
    assert (
        _value(families, "moeserve_prompt_tokens", "moeserve_prompt_tokens_total", api="grpc") == 7
    )
    assert (
        _value(
            families, "moeserve_generation_tokens", "moeserve_generation_tokens_total", api="grpc"
        )
        == 5
    )
    assert (
        _value(
            families,
            "moeserve_requests",
            "moeserve_requests_total",
            api="grpc",
            status="ok",
            finish_reason="stop",
        )
        == 1
    )
    assert (
        _value(
            families,
            "moeserve_requests",
            "moeserve_requests_total",
            api="rest",
            status="ok",
            finish_reason="abort",
        )
        == 1
    )
    ttft = "moeserve_time_to_first_token_seconds"
    assert _value(families, ttft, ttft + "_sum", api="grpc") == pytest.approx(1.0)
    assert _value(families, ttft, ttft + "_bucket", api="grpc", le="1.0") == 1
    assert _value(families, ttft, ttft + "_bucket", api="grpc", le="0.75") == 0
    tpot = "moeserve_time_per_output_token_seconds"
    assert _value(families, tpot, tpot + "_count", api="grpc") == 1
    assert _value(families, tpot, tpot + "_count", api="rest") == 0  # no output tokens
    queue = "moeserve_request_queue_time_seconds"
    assert _value(families, queue, queue + "_count") == 2


def test_exemplars_only_in_openmetrics(metrics, registry):
    metrics.observe_request("rest", _times(), 7, 5, "length", "ok", TRACE_ID)
    families, text, content_type = _families(registry, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")
    for name in (
        "moeserve_time_to_first_token_seconds",
        "moeserve_time_per_output_token_seconds",
        "moeserve_e2e_request_latency_seconds",
    ):
        exemplars = [s.exemplar for s in families[name].samples if s.exemplar]
        assert exemplars, name
        assert all(e.labels == {"trace_id": TRACE_ID} for e in exemplars)
    _, classic, _ = _families(registry, "text/plain")
    assert TRACE_ID not in classic and "# {" not in classic
    _, default, _ = _families(registry, None)
    assert TRACE_ID not in default


def test_rejections_and_errors_are_bounded(metrics, registry):
    metrics.count_rejected("rest")
    metrics.count_request("grpc", status_from_grpc("INVALID_ARGUMENT"))
    metrics.count_request("rest", "weird-status", "weird-reason")
    with pytest.raises(ValueError):
        metrics.count_request("/v1/completions?id=123", "ok")
    families, _, _ = _families(registry)
    total = "moeserve_requests_total"
    assert (
        _value(
            families,
            "moeserve_requests",
            total,
            api="rest",
            status="rejected",
            finish_reason="none",
        )
        == 1
    )
    assert (
        _value(
            families,
            "moeserve_requests",
            total,
            api="grpc",
            status="client_error",
            finish_reason="none",
        )
        == 1
    )
    assert (
        _value(
            families,
            "moeserve_requests",
            total,
            api="rest",
            status="server_error",
            finish_reason="none",
        )
        == 1
    )
    series = [s for s in families["moeserve_requests"].samples if s.name == total]
    assert len(series) == 2 * len(STATUSES) * len(FINISH_REASONS)  # nothing new appeared


def test_status_mappings():
    assert [status_from_http(c) for c in (200, 400, 401, 404, 413, 429, 500, 503)] == [
        "ok",
        "client_error",
        "client_error",
        "client_error",
        "client_error",
        "rejected",
        "server_error",
        "server_error",
    ]
    code = SimpleNamespace(name="RESOURCE_EXHAUSTED")  # like grpc.StatusCode
    assert status_from_grpc(code) == "rejected"
    assert status_from_grpc("OK") == "ok"
    assert status_from_grpc("CANCELLED") == "client_error"
    assert status_from_grpc("INTERNAL") == "server_error"


def test_observe_step_gauges_and_experts(metrics, registry):
    metrics.observe_step(_step([[3, 1, 0, 0], [1, 1, 1, 1]], num_preemptions=2))
    families, _, _ = _families(registry)
    assert _value(families, "moeserve_num_requests_running", "moeserve_num_requests_running") == 3
    assert _value(families, "moeserve_num_requests_waiting", "moeserve_num_requests_waiting") == 2
    assert (
        _value(families, "moeserve_kv_cache_usage_ratio", "moeserve_kv_cache_usage_ratio") == 0.25
    )
    assert _value(families, "moeserve_preemptions", "moeserve_preemptions_total") == 2
    assert _value(families, "moeserve_batch_size", "moeserve_batch_size_bucket", le="4.0") == 1
    assert (
        _value(families, "moeserve_engine_step_seconds", "moeserve_engine_step_seconds_count") == 1
    )
    experts = "moeserve_moe_expert_tokens_total"
    assert _value(families, "moeserve_moe_expert_tokens", experts, layer="0", expert="0") == 3
    assert _value(families, "moeserve_moe_expert_tokens", experts, layer="0", expert="2") == 0
    imbalance = "moeserve_moe_expert_imbalance"
    assert _value(families, imbalance, imbalance, layer="0") == pytest.approx(
        3 / 1
    )  # max 3, mean 1
    assert _value(families, imbalance, imbalance, layer="1") == pytest.approx(1.0)


def test_imbalance_window_is_counted_in_routed_tokens(registry):
    # a window of 4 routed tokens per expert: 8 tokens for 2 experts
    m = ServiceMetrics(
        registry, "m", num_layers=1, num_experts=2, max_waiting=8, expert_window_tokens=4
    )

    def imbalance():
        return registry.get_sample_value(
            "moeserve_moe_expert_imbalance", {"model": "m", "layer": "0"}
        )

    assert imbalance() == 0.0  # nothing routed yet
    m.observe_step(_step([[4, 0]]))
    assert imbalance() == pytest.approx(2.0)  # all on one expert: num_experts
    m.observe_step(_step([[1, 1]]))  # 2 tokens decay the window by exp(-2/8)
    kept = 4 * math.exp(-2 / 8)
    assert imbalance() == pytest.approx((kept + 1) / ((kept + 2) / 2))
    for _ in range(40):  # 80 balanced tokens: the [4, 0] step has decayed away
        m.observe_step(_step([[1, 1]]))
    assert imbalance() == pytest.approx(1.0, abs=1e-3)
    m.observe_step(_step(None))  # steps without router stats leave the window alone
    assert imbalance() == pytest.approx(1.0, abs=1e-3)
    m.observe_step(_step([[5, 1, 9], [7, 7]]))  # extra layers/experts are ignored
    counter = registry.get_sample_value(
        "moeserve_moe_expert_tokens_total", {"model": "m", "layer": "0", "expert": "0"}
    )
    assert counter == 4 + 41 + 5


def test_fresh_registries_do_not_clash():
    for _ in range(3):
        ServiceMetrics(CollectorRegistry(), "m", 1, 1, 1)


def test_observe_step_is_cheap(registry):
    layers, experts = 16, 64
    m = ServiceMetrics(registry, "m", layers, experts, 256)
    steps = [
        _step([[(i + e) % 7 for e in range(experts)] for _ in range(layers)]) for i in range(8)
    ]
    started = time.perf_counter()
    for i in range(500):
        m.observe_step(steps[i % 8])
    per_step = (time.perf_counter() - started) / 500
    print(f"observe_step {layers}x{experts}: {per_step * 1e3:.3f} ms")
    assert per_step < 0.01


def test_structured_requests_by_kind_and_grammar_compile_time(metrics, registry):
    families, _, _ = _families(registry)
    kinds = {
        s.labels["kind"]: s.value
        for s in families["moeserve_structured_requests"].samples
        if s.name == "moeserve_structured_requests_total"
    }
    assert kinds == dict.fromkeys(STRUCTURED_KINDS, 0)  # every kind exported from start-up
    metrics.count_structured("json")
    metrics.count_structured("json")
    metrics.count_structured("choice")
    with pytest.raises(ValueError):
        metrics.count_structured("xml")
    metrics.observe_grammar_compile(0.0015, False)
    metrics.observe_grammar_compile(0.000004, True)
    metrics.observe_grammar_compile(0.3, None)  # unknown counts as a compile (miss)
    families, _, _ = _families(registry)
    total = "moeserve_structured_requests_total"
    assert _value(families, "moeserve_structured_requests", total, kind="json") == 2
    assert _value(families, "moeserve_structured_requests", total, kind="choice") == 1
    assert _value(families, "moeserve_structured_requests", total, kind="regex") == 0
    name = "moeserve_grammar_compile_seconds"
    assert _value(families, name, f"{name}_count", cache="miss") == 2
    assert _value(families, name, f"{name}_count", cache="hit") == 1
    assert _value(families, name, f"{name}_bucket", cache="miss", le="0.0025") == 1
    assert _value(families, name, f"{name}_bucket", cache="hit", le="1e-05") == 1
    assert round(_value(families, name, f"{name}_sum", cache="miss"), 6) == 0.3015
