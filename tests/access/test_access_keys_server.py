"""Named API keys and their limits on a real server (in this process, REST and gRPC): each
key's requests carry its name in requests_total and the summary line; over a limit a request
gets 429 with Retry-After (RESOURCE_EXHAUSTED with google.rpc.RetryInfo and `retry-after` on
gRPC), counted in moeserve_rate_limited_total{key, limit}, and never reaches the engine."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from structlog.testing import capture_logs

from bench.harness import InProcessServer, iter_sse
from service.api_keys import digest
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from tests.access.conftest import settings, write_keys

KEYS = {
    "team-a": "sk-team-a-0123456789",  # 3 requests a minute
    "team-b": "sk-team-b-abcdefghij",  # 1 request at a time (given to the server as sha256)
    "team-c": "sk-team-c-zyxwvutsrq",  # 60 tokens a minute
    "team-d": "sk-team-d-no-limits-",
}
SINGLE = "sk-single-unnamed-key"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    path = write_keys(
        tmp_path_factory.mktemp("keys") / "keys.json",
        {"name": "team-a", "key": KEYS["team-a"], "requests_per_minute": 3},
        {"name": "team-b", "sha256": digest(KEYS["team-b"]).hex(), "max_concurrent": 1},
        {"name": "team-c", "key": KEYS["team-c"], "tokens_per_minute": 60},
        {"name": "team-d", "key": KEYS["team-d"]},
    )
    config = settings(tiny_model_dir, grpc_port=0, api_keys_file=str(path), api_key=SINGLE)
    with InProcessServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.grpc_target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _sample(srv, name: str, **labels) -> float:
    labels = {"model": srv.state.model_name, **labels}
    return srv.state.observability.metrics.registry.get_sample_value(name, labels) or 0.0


def _requests(srv, key: str, api: str = "rest", status: str = "ok", reason: str = "length"):
    return _sample(
        srv, "moeserve_requests_total", api=api, status=status, finish_reason=reason, key=key
    )


def _rate_limited(srv, key: str, limit: str, api: str = "rest") -> float:
    return _sample(srv, "moeserve_rate_limited_total", api=api, key=key, limit=limit)


def _complete(srv, key: str, max_tokens: int = 2, **body) -> httpx.Response:
    body = {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, **body}
    return httpx.post(srv.url + COMP, json=body, headers=_auth(key), timeout=30)


def _assert_429(r: httpx.Response, limit: str) -> int:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert limit in error["message"]
    retry_after = int(r.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def test_every_key_is_exported_from_start_up(srv):
    """Before any request: requests_total for every name the ring can give, and
    rate_limited_total for each key's configured limits, at 0 (team-d has none)."""
    for key in (*KEYS, "default", "unauthenticated"):
        assert (
            srv.state.observability.metrics.registry.get_sample_value(
                "moeserve_requests_total",
                {
                    "model": srv.state.model_name,
                    "api": "grpc",
                    "status": "server_error",
                    "finish_reason": "none",
                    "key": key,
                },
            )
            == 0
        ), key
    assert _rate_limited(srv, "team-a", "requests_per_minute", api="grpc") == 0
    text = httpx.get(srv.url + "/metrics").text
    assert 'key="team-b",limit="max_concurrent"' in text
    assert 'key="team-c",limit="tokens_per_minute"' in text
    assert 'key="team-d",limit=' not in text


def test_each_key_is_known_by_its_name(srv, stub):
    before = {k: _requests(srv, k) for k in ("team-d", "default")}
    before_grpc = _requests(srv, "team-d", api="grpc")
    refused = _requests(srv, "unauthenticated", status="client_error", reason="none")
    with capture_logs() as logs:
        assert _complete(srv, KEYS["team-d"]).status_code == 200
        assert _complete(srv, SINGLE).status_code == 200
        assert _complete(srv, "sk-not-a-key").status_code == 401
        assert httpx.post(srv.url + COMP, json={"prompt": "x"}).status_code == 401
        reply = stub.Generate(
            pb.GenerateRequest(
                prompt="hi", params=pb.SamplingParams(max_tokens=2, ignore_eos=True)
            ),
            metadata=tuple(_auth(KEYS["team-d"]).items()),
            timeout=30,
        )
        assert len(reply.token_ids) == 2
    assert _requests(srv, "team-d") == before["team-d"] + 1
    assert _requests(srv, "default") == before["default"] + 1
    assert _requests(srv, "team-d", api="grpc") == before_grpc + 1
    assert _requests(srv, "unauthenticated", status="client_error", reason="none") == refused + 2
    summaries = [r for r in logs if r["event"] == "request finished"]
    assert [(s["api"], s["status"], s["key"]) for s in summaries] == [
        ("rest", "ok", "team-d"),
        ("rest", "ok", "default"),
        ("rest", "client_error", "unauthenticated"),
        ("rest", "client_error", "unauthenticated"),
        ("grpc", "ok", "team-d"),
    ]
    for key in (*KEYS.values(), SINGLE, "sk-not-a-key"):
        assert key not in repr(logs)


def test_requests_per_minute(srv, stub):
    engine_finished = len(srv.finished)
    for _ in range(3):
        assert _complete(srv, KEYS["team-a"]).status_code == 200
    with capture_logs() as logs:
        r = _complete(srv, KEYS["team-a"])
    # 3 a minute: one more comes back within 20 s
    assert _assert_429(r, "requests_per_minute") <= 20
    assert _rate_limited(srv, "team-a", "requests_per_minute") == 1
    assert _requests(srv, "team-a", status="rejected", reason="none") == 1
    (line,) = [r for r in logs if r["event"] == "request finished"]
    assert (line["status"], line["key"]) == ("rejected", "team-a")
    # the same key over gRPC shares the allowance: RESOURCE_EXHAUSTED with RetryInfo
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            pb.GenerateRequest(
                prompt="hi", params=pb.SamplingParams(max_tokens=2, ignore_eos=True)
            ),
            metadata=tuple(_auth(KEYS["team-a"]).items()),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute" in err.value.details()
    trailers = dict(err.value.trailing_metadata())
    assert 1 <= int(trailers["retry-after"]) <= 20
    status = rpc_status.from_call(err.value)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.seconds == int(trailers["retry-after"])
    assert _rate_limited(srv, "team-a", "requests_per_minute", api="grpc") == 1
    # the engine ran the 3 admitted requests only; other keys are not held back
    assert len(srv.finished) == engine_finished + 3
    assert _complete(srv, KEYS["team-d"]).status_code == 200


def test_max_concurrent(srv):
    key = KEYS["team-b"]
    body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, headers=_auth(key), timeout=30) as http:
        with http.stream("POST", COMP, json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # admitted and streaming
            _assert_429(http.post(COMP, json={"prompt": "b", "max_tokens": 2}), "max_concurrent")
            events = [e for _, e in iter_sse(lines)]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert http.post(COMP, json={"prompt": "b", "max_tokens": 2}).status_code == 200
    assert _rate_limited(srv, "team-b", "max_concurrent") == 1


def test_tokens_per_minute_are_charged_as_produced(srv):
    key = KEYS["team-c"]
    bucket = srv.state.keys.authenticate(f"Bearer {key}").limiter.token_bucket
    started = time.monotonic()
    r = _complete(srv, key, max_tokens=40)
    assert r.status_code == 200
    usage = r.json()["usage"]
    # 60 a minute (1 a second), full at first: what is left is what the request did not use,
    # plus what came back while it ran
    left = 60 - usage["total_tokens"]
    assert left <= bucket.level <= left + time.monotonic() - started + 0.01
    assert _complete(srv, key, max_tokens=40).status_code == 200  # ~17 left: the prompt fits
    assert bucket.level < 0  # the second request's generation went into debt
    started = time.monotonic()
    r = _complete(srv, key)
    retry_after = _assert_429(r, "tokens_per_minute")
    # 1 token a second: the debt plus the prompt, less what came back meanwhile
    owed = -bucket.level + usage["prompt_tokens"]
    assert retry_after == pytest.approx(owed, abs=2 + time.monotonic() - started)
    assert _rate_limited(srv, "team-c", "tokens_per_minute") == 1
