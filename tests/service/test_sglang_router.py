"""SGLang's gateway (pip sglang-router 0.3.2, a dev dependency; `sglang-router launch`) in front
of two `moeserve serve` replicas on free 127.0.0.1 ports, unmodified (issue 36): under
cache_aware and round_robin every chat and completion that names its model is served, whole
and streamed.

What it needs: the client names the model. The gateway learns a worker's model from SGLang's
own /model_info and /server_info (and their /get_ forms), which moeserve does not serve; it
then files the workers under model "unknown", forwards a chat without `model` as model
"unknown" (our 404 model_not_found), and refuses a completion without `model` itself (422)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec
import pytest

from bench.harness import HOST, ManagedProcess, ServerProcess, free_port, wait_until

GATEWAY = Path(sys.executable).with_name("sglang-router")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GATEWAY.exists(), reason="sglang-router (a dev dependency) is missing"),
]
MODEL = "tiny"
SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4"]
SERVE += ["--kv-cache-tokens", "4096", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir) -> Iterator[list[ServerProcess]]:
    with ExitStack() as stack:
        servers = [ServerProcess(tiny_model_dir, *SERVE, start_timeout=180) for _ in range(2)]
        for server in servers:
            stack.callback(server.stop)
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers


@pytest.fixture(scope="module", params=["cache_aware", "round_robin"])
def gateway(request, replicas) -> Iterator[httpx.Client]:
    port = free_port()
    argv = [
        GATEWAY, "launch", "--host", HOST, "--port", port, "--policy", request.param,
        "--worker-urls", *(s.url for s in replicas), "--log-level", "warn",
    ]  # fmt: skip
    process = ManagedProcess(argv, stop_timeout=10, name="sglang-router")
    process.start()
    try:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=60) as http:
            wait_until(
                lambda: http.get("/v1/models").status_code == 200,
                60,
                "the gateway ready",
                0.5,
                (httpx.HTTPError,),
            )
            yield http
    finally:
        process.stop()


def _sse_events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", response.text
    return [msgspec.json.decode(line) for line in lines[:-1]]


def test_the_gateway_serves_chats_and_completions_that_name_the_model(gateway, replicas):
    served_before = [_finished(s) for s in replicas]
    for i in range(3):
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "ignore_eos": True,  # the random-weight model may sample its EOS before 4 tokens
        }
        whole = gateway.post("/v1/chat/completions", json={**chat, "seed": i})
        assert whole.status_code == 200, whole.text
        assert whole.json()["object"] == "chat.completion"
        assert whole.json()["usage"]["completion_tokens"] == 4
        streamed = gateway.post("/v1/chat/completions", json={**chat, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert _sse_events(streamed)[0]["object"] == "chat.completion.chunk"
        text = {"model": MODEL, "prompt": f"Count to {i + 3}:", "max_tokens": 4, "ignore_eos": True}
        completion = gateway.post("/v1/completions", json=text)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 4
        streamed = gateway.post("/v1/completions", json={**text, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert _sse_events(streamed)[0]["object"] == "text_completion"
    # every request reached a replica and finished there (its log line can lag the answer)
    wait_until(
        lambda: sum(_finished(s) for s in replicas) - sum(served_before) == 12,
        10,
        "the replicas' 12 'request finished' lines",
    )


def test_without_the_model_the_gateway_cannot_name_it(gateway):
    """What it needs (module doc): a chat without `model` reaches a replica as model
    "unknown"; a completion without it stops at the gateway."""
    chat = gateway.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    assert "unknown" in chat.json()["error"]["message"]
    assert gateway.post("/v1/completions", json={"prompt": "Hi"}).status_code == 422


def _finished(server: ServerProcess) -> int:
    return sum(1 for r in list(server.records) if r.get("event") == "request finished")
