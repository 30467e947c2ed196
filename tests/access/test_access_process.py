"""A real `moeserve serve` process with named keys (bench.harness.ServerProcess): revoking a
key by editing the file and sending SIGHUP refuses its next request while its stream in
flight completes; a file that does not load leaves the keys as they were. Then, over a run
with several keys on both APIs (good, wrong, revoked, over their limits), not one log line or
exported span (OTEL_TRACES_EXPORTER=console, every request header asked for on the span)
holds a key or a prompt, nor does the request inspector's JSON, while the key names are
there."""

from __future__ import annotations

import signal
import time

import grpc
import httpx
import pytest

from bench.harness import ServerProcess, iter_sse
from service.api_keys import digest
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from tests.access.conftest import write_keys

pytestmark = pytest.mark.slow

KEYS = {
    "team-a": "sk-proc-team-a-7f3c9e1d",
    "team-b": "sk-proc-team-b-0a4b8c2e",
    "team-c": "sk-proc-team-c-5d6e7f80",  # written as its sha256
    "team-e": "sk-proc-team-e-91a2b3c4",  # added by the reload
}
WRONG = "sk-proc-wrong-key-deadbeef"
PROMPT = "zebra quartz marmalade"  # a prompt to look for (no --log-prompts)
COMP = "/v1/completions"
STREAMED = 400  # tokens: a stream that outlasts a reload and the next request


def _entries(*names: str, requests_per_minute: int = 60) -> list[dict]:
    out = []
    for name in names:
        if name == "team-c":
            out.append({"name": name, "sha256": digest(KEYS[name]).hex(), "max_concurrent": 4})
        else:
            out.append(
                {"name": name, "key": KEYS[name], "requests_per_minute": requests_per_minute}
            )
    return out


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("keys") / "keys.json", *_entries("team-a", "team-b"))


@pytest.fixture(scope="module")
def srv(tiny_model_dir, keys_file):
    env = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        # an operator asking for every request header on the span: credentials stay out
        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST": ".*",
    }
    with ServerProcess(
        tiny_model_dir, "--api-keys-file", keys_file, grpc=True, env=env, start_timeout=120
    ) as server:
        yield server


def _post(srv, key: str, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 3, **body}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(srv.url + COMP, json=body, headers=headers, timeout=60)


def _reload(srv) -> dict:
    """SIGHUP, then the server's line about it ("API keys reloaded" or "... not reloaded")."""

    def about_keys(record: dict) -> bool:
        return str(record.get("event", "")).startswith("API keys")

    before = sum(map(about_keys, srv.records))
    srv.proc.send_signal(signal.SIGHUP)
    return srv.wait_for(about_keys, count=before + 1, timeout=10)[before]


def test_sighup_revokes_a_key_while_its_stream_completes(srv, keys_file):
    assert srv.started["api_keys"] == 2
    body = {"prompt": PROMPT, "max_tokens": STREAMED, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {KEYS['team-b']}"}
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        with http.stream("POST", COMP, json=body, headers=headers) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # in flight
            write_keys(keys_file, *_entries("team-a", "team-c", "team-e"))
            reloaded = _reload(srv)
            assert reloaded["event"] == "API keys reloaded", reloaded
            assert reloaded["keys"] == ["team-a", "team-c", "team-e"]
            refused = _post(srv, KEYS["team-b"])
            refused_at = time.perf_counter()
            assert refused.status_code == 401, refused.text
            events = list(iter_sse(lines))
        assert events[-1][0] > refused_at, "the stream ended before the key was revoked"
        assert events[-1][1]["choices"][0]["finish_reason"] == "length"
    for name in ("team-a", "team-c", "team-e"):
        assert _post(srv, KEYS[name]).status_code == 200, name

    # a file that does not load: an error line, and the keys in force stay
    keys_file.write_text('{"keys": [{"name": "team-a"}]}')
    failed = _reload(srv)
    assert failed["event"] == "API keys not reloaded; the previous keys stay in force"
    assert failed["level"] == "error" and "exactly one of" in failed["error"]
    assert _post(srv, KEYS["team-e"]).status_code == 200
    assert srv.poll() is None
    write_keys(keys_file, *_entries("team-a", "team-c", "team-e"))

    summaries = [r for r in srv.records if r.get("event") == "request finished"]
    assert {"team-b", "team-c", "team-e", "unauthenticated"} <= {s["key"] for s in summaries}
    # the whole generation came through (counted by the server: a stream that falls behind
    # carries several tokens in one event)
    (streamed,) = [s for s in summaries if s["completion_tokens"] == STREAMED]
    assert (streamed["key"], streamed["status"]) == ("team-b", "ok")
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'finish_reason="length",key="team-b",model=' in metrics
    assert 'key="team-e",limit="requests_per_minute"' in metrics  # a new key is exported


def test_no_key_or_prompt_in_any_log_line_or_span(srv, keys_file):
    write_keys(keys_file, *_entries("team-a", "team-c", "team-e", requests_per_minute=4))
    assert _reload(srv)["event"] == "API keys reloaded"
    for name in ("team-a", "team-c", "team-e"):
        assert _post(srv, KEYS[name], stream=True).status_code == 200
    assert _post(srv, WRONG).status_code == 401
    assert _post(srv, KEYS["team-b"]).status_code == 401  # revoked above
    with grpc.insecure_channel(srv.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, params=pb.SamplingParams(max_tokens=3))
        for key in (KEYS["team-a"], WRONG):
            try:
                stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and key == WRONG
    rejected = [_post(srv, KEYS["team-a"]).status_code for _ in range(3)]
    assert rejected[-1] == 429  # 4 a minute, the 5th (gRPC's included) is refused

    # the inspector names each request's key, never the key (nor, without --log-prompts,
    # the prompt)
    auth = {"authorization": f"Bearer {KEYS['team-e']}"}
    listed = httpx.get(srv.url + "/inspect/api/requests?limit=100", headers=auth).json()
    pages = [httpx.get(srv.url + "/inspect/api/engine", headers=auth).text]
    for row in listed["requests"]:
        path = f"/inspect/api/requests/{row['id']}"
        pages.append(httpx.get(srv.url + path, headers=auth).text)
    assert {"team-a", "team-c", "team-e", "unauthenticated"} <= {
        r["key"] for r in listed["requests"]
    }
    inspected = "\n".join([str(listed), *pages])
    assert not [s for s in (*KEYS.values(), WRONG, PROMPT, "zebra") if s in inspected]
    assert srv.stop() == 0  # flushes the spans

    text = srv.log_text()
    secrets = [*KEYS.values(), WRONG, digest(KEYS["team-c"]).hex(), PROMPT, "zebra"]
    leaks = [s for s in secrets if s in text]
    assert not leaks, f"found in the server's output: {leaks}"

    records = srv.records
    spans = [r for r in records if "context" in r and "kind" in r]
    assert spans, "no span was exported"
    servers = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert {"team-a", "team-c", "team-e"} <= {s["attributes"].get("moeserve.key") for s in servers}
    captured = [
        s["attributes"]["http.request.header.authorization"]
        for s in servers
        if "http.request.header.authorization" in s["attributes"]
    ]
    assert captured and all(v == ["[REDACTED]"] for v in captured), captured[:3]
    assert any("http.request.header.content_type" in s["attributes"] for s in servers)
    logs = [r for r in records if "event" in r]
    assert {"team-a", "team-c", "team-e", "unauthenticated"} <= {r.get("key") for r in logs}
    assert "Bearer sk-" not in text  # no Authorization header, whoever's
