"""moeserve_api_requests_total: REST and gRPC requests by type and the status they got, with
bounded labels; moeserve_requests_total keeps its own labels."""

from __future__ import annotations

import grpc
import httpx
import pytest

from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from telemetry.api_requests import http_status_label


@pytest.fixture(scope="module")
def srv(start_server):
    with start_server(grpc_port=0) as s:
        yield s


def _count(srv, api, request_type, http_status="", grpc_code="") -> float:
    labels = {
        "model": srv.state.model_name,
        "api": api,
        "request_type": request_type,
        "http_status": http_status,
        "grpc_code": grpc_code,
    }
    registry = srv.state.observability.metrics.registry
    return registry.get_sample_value("moeserve_api_requests_total", labels) or 0.0


def test_rest_requests_count_by_route_kind_and_status(srv):
    cases = [
        ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "completion", "200"),
        ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": "x"}, "completion", "400"),
        ("post", "/v1/chat/completions", {"messages": []}, "chat", "400"),
        ("post", "/tokenize", {"prompt": "Hi"}, "tokenize", "200"),
        ("get", "/v1/models", None, "models", "200"),
        (
            "post",
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "Hi"}]},
            "chat_render",
            "200",
        ),
        ("post", "/v1/completions/render", {"prompt": "Hi", "n": 0}, "completion_render", "400"),
        ("post", "/v1/completions", {"prompt": "Hi", "model": "nope"}, "completion", "404"),
    ]
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for method, path, body, kind, status in cases:
            before = _count(srv, "rest", kind, http_status=status)
            resp = getattr(http, method)(path, **({"json": body} if body is not None else {}))
            assert resp.status_code == int(status), (path, resp.text)
            assert _count(srv, "rest", kind, http_status=status) == before + 1, (path, status)
        before = sum(_count(srv, "rest", k, "200") for k in ("completion", "chat", "tokenize"))
        assert http.get("/health").status_code == 200  # probes are no API request type
        assert http.get("/nowhere").status_code == 404
        after = sum(_count(srv, "rest", k, "200") for k in ("completion", "chat", "tokenize"))
        assert after == before
    exposition = httpx.get(srv.url + "/metrics").text
    assert 'request_type="detokenize"' in exposition  # exported from start-up


def test_grpc_requests_count_by_method_and_code(srv):
    with grpc.insecure_channel(srv.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        before_ok = _count(srv, "grpc", "Generate", grpc_code="OK")
        before_bad = _count(srv, "grpc", "Generate", grpc_code="INVALID_ARGUMENT")
        stub.Generate(
            pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_tokens=2)), timeout=30
        )
        with pytest.raises(grpc.RpcError):
            stub.Generate(pb.GenerateRequest(), timeout=30)  # neither prompt nor messages
        before_info = _count(srv, "grpc", "ModelInfo", grpc_code="OK")
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert _count(srv, "grpc", "Generate", grpc_code="OK") == before_ok + 1
    assert _count(srv, "grpc", "Generate", grpc_code="INVALID_ARGUMENT") == before_bad + 1
    assert _count(srv, "grpc", "ModelInfo", grpc_code="OK") == before_info + 1


def test_unusual_statuses_fall_into_their_class():
    assert http_status_label(200) == "200" and http_status_label(429) == "429"
    assert http_status_label(418) == "4xx" and http_status_label(502) == "5xx"
