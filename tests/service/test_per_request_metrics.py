"""Per-request metrics (vLLM's --enable-per-request-metrics / `include_metrics`): the numbers
a response carries are the observations the request made in the latency histograms, on REST
(through the official `openai` client) and gRPC, whole and streamed, and the inspector's."""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest

from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc

FIELDS = (
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
)
# histogram -> the `metrics` field it observed (seconds there, milliseconds here)
HISTOGRAMS = {
    "moeserve_time_to_first_token_seconds": "time_to_first_token_ms",
    "moeserve_e2e_request_latency_seconds": "generation_time_ms",
    "moeserve_time_per_output_token_seconds": "mean_itl_ms",
    "moeserve_request_queue_time_seconds": "queue_time_ms",
}


@pytest.fixture(scope="module")
def srv(start_server):
    with start_server(enable_per_request_metrics=True, grpc_port=0) as s:
        yield s


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _samples(srv, api: str, suffix: str) -> dict[str, float]:
    """Each latency histogram's _sum or _count for `api` (queue time has no api label)."""
    registry, model = srv.state.observability.metrics.registry, srv.state.model_name
    out = {}
    for name in HISTOGRAMS:
        labels = {"model": model} if "queue" in name else {"model": model, "api": api}
        out[name] = registry.get_sample_value(name + suffix, labels) or 0.0
    return out


def _histograms_now(srv, api: str) -> dict[str, dict[str, float]]:
    """Each histogram's sum and count, before a request."""
    return {"sum": _samples(srv, api, "_sum"), "count": _samples(srv, api, "_count")}


def _observed(srv, api: str, before: dict) -> dict[str, float]:
    """What one request observed, in the response's milliseconds. The server records a
    request when it has answered: a streamed response's last chunk can reach the client
    first, so this waits (bounded) until every histogram has counted it."""
    deadline = time.monotonic() + 10
    while _samples(srv, api, "_count") != {n: c + 1 for n, c in before["count"].items()}:
        assert time.monotonic() < deadline, "the request's observations never landed"
        time.sleep(0.01)
    after = _samples(srv, api, "_sum")
    return {HISTOGRAMS[n]: (after[n] - before["sum"][n]) * 1e3 for n in HISTOGRAMS}


def _check(metrics: dict, observed: dict, completion_tokens: int) -> None:
    assert set(metrics) == set(FIELDS)
    for field, ms in observed.items():
        assert metrics[field] == pytest.approx(ms, rel=1e-6, abs=1e-6), field
    assert metrics["time_to_first_token_ms"] > 0
    assert metrics["generation_time_ms"] >= metrics["time_to_first_token_ms"]
    assert metrics["tokens_per_second"] == pytest.approx(
        completion_tokens / (metrics["generation_time_ms"] / 1e3), rel=1e-9
    )


def _inspected(srv, response_id: str) -> dict:
    body = httpx.get(f"{srv.url}/inspect/api/requests/{response_id}", timeout=10).json()
    return body["metrics"]


def test_whole_completion_carries_its_histogram_observations(srv, client):
    before = _histograms_now(srv, "rest")
    resp = client.completions.create(
        model=srv.state.model_name,
        prompt="def fibonacci(n):",
        max_tokens=6,
        temperature=0,
        extra_body={"include_metrics": True},
    )
    metrics = resp.model_extra["metrics"]
    _check(metrics, _observed(srv, "rest", before), resp.usage.completion_tokens)
    assert resp.usage.completion_tokens >= 2  # mean_itl_ms is a number, not None
    assert _inspected(srv, resp.id) == pytest.approx(metrics)


def test_streamed_chat_carries_them_on_its_last_chunk(srv, client):
    before = _histograms_now(srv, "rest")
    stream = client.chat.completions.create(
        model=srv.state.model_name,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"include_metrics": True},
    )
    chunks = list(stream)
    *body, last = chunks
    assert all("metrics" not in (c.model_extra or {}) for c in body)
    assert last.choices == [] and last.usage is not None
    metrics = last.model_extra["metrics"]
    _check(metrics, _observed(srv, "rest", before), last.usage.completion_tokens)
    assert _inspected(srv, last.id) == pytest.approx(metrics)


def test_responses_without_include_metrics_have_no_metrics(srv, client):
    resp = client.completions.create(
        model=srv.state.model_name, prompt="Hello", max_tokens=2, temperature=0
    )
    assert "metrics" not in (resp.model_extra or {})


def _grpc_metrics(message: pb.GenerateResponse) -> dict:
    m = message.metrics
    return {f: getattr(m, f) if m.HasField(f) else None for f in FIELDS}


def test_grpc_generate_and_stream_carry_them(srv):
    with grpc.insecure_channel(srv.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        params = pb.SamplingParams(max_tokens=5, temperature=0)
        request = pb.GenerateRequest(prompt="def f(x):", params=params, include_metrics=True)
        before = _histograms_now(srv, "grpc")
        whole = stub.Generate(request, timeout=30)
        _check(
            _grpc_metrics(whole),
            _observed(srv, "grpc", before),
            whole.usage.completion_tokens,
        )
        before = _histograms_now(srv, "grpc")
        *body, last = list(stub.GenerateStream(request, timeout=30))
        assert not any(m.HasField("metrics") for m in body)
        _check(_grpc_metrics(last), _observed(srv, "grpc", before), last.usage.completion_tokens)


def test_include_metrics_without_the_flag_is_a_400_naming_it(server):
    resp = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2, "include_metrics": True},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "include_metrics"
