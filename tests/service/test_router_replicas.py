"""vLLM's own router (pip vllm-router 0.1.17, a dev dependency) in front of two `moeserve serve`
replicas on free 127.0.0.1 ports, unmodified (issue 36): under cache_aware and power_of_two
every chat and completion it forwards, with the fields it adds to each body, is served, whole
and streamed. The replicas and the router are processes this test starts and stops."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec
import pytest

from bench.harness import HOST, ManagedProcess, ServerProcess, free_port, wait_until

ROUTER = Path(sys.executable).with_name("vllm-router")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing"),
]
MESSAGES = [{"role": "user", "content": "Name a colour."}]
SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4"]
SERVE += ["--kv-cache-tokens", "4096"]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir) -> Iterator[list[ServerProcess]]:
    with ExitStack() as stack:
        servers = [ServerProcess(tiny_model_dir, *SERVE, start_timeout=180) for _ in range(2)]
        for server in servers:  # both start at once: each waits for its own readiness below
            stack.callback(server.stop)
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers


def _router(replicas: list[ServerProcess], policy: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [
        ROUTER, "--host", HOST, "--port", port, "--policy", policy,
        "--worker-urls", *(s.url for s in replicas), "--log-level", "warning",
    ]  # fmt: skip
    return ManagedProcess(argv, stop_timeout=10, name="vllm-router"), f"http://{HOST}:{port}"


def _sse_events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", response.text
    return [msgspec.json.decode(line) for line in lines[:-1]]


@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two"])
def test_the_router_serves_chats_and_completions_through_the_replicas(replicas, policy):
    router, url = _router(replicas, policy)
    router.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            wait_until(lambda: http.get("/v1/models").status_code == 200, 60, "the router ready")
            for i in range(3):
                # ignore_eos: the random-weight model may sample its EOS before 4 tokens
                chat = {"messages": MESSAGES, "max_tokens": 4, "seed": i, "ignore_eos": True}
                whole = http.post("/v1/chat/completions", json=chat)
                assert whole.status_code == 200, whole.text
                body = whole.json()
                assert body["object"] == "chat.completion"
                assert body["usage"]["completion_tokens"] == 4
                streamed = http.post("/v1/chat/completions", json={**chat, "stream": True})
                assert streamed.status_code == 200, streamed.text
                chunks = _sse_events(streamed)
                assert chunks[0]["object"] == "chat.completion.chunk"
                text = {"prompt": f"Count to {i + 3}:", "max_tokens": 4, "ignore_eos": True}
                completion = http.post("/v1/completions", json=text)
                assert completion.status_code == 200, completion.text
                assert completion.json()["usage"]["completion_tokens"] == 4
                streamed = http.post("/v1/completions", json={**text, "stream": True})
                assert streamed.status_code == 200, streamed.text
                assert _sse_events(streamed)[0]["object"] == "text_completion"
    finally:
        router.stop()


def _logged(replicas: list[ServerProcess], trace_id: str) -> bool:
    return any(
        r.get("event") == "request finished" and r.get("trace_id") == trace_id
        for server in replicas
        for r in server.records
    )


def test_a_clients_traceparent_reaches_the_replica_through_the_router(replicas):
    """vLLM's router forwards `traceparent`: the replica's request span joins the client's
    trace (its "request finished" line carries the client's trace id)."""
    router, url = _router(replicas, "round_robin")
    router.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            wait_until(lambda: http.get("/v1/models").status_code == 200, 60, "the router ready")
            for i in range(2):  # round robin: one request on each replica
                trace_id = f"{i + 1:032x}"
                headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
                body = {"messages": MESSAGES, "max_tokens": 2}
                response = http.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                wait_until(
                    lambda tid=trace_id: _logged(replicas, tid), 10, "the replica's request line"
                )
    finally:
        router.stop()
