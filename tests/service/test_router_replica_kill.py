"""A replica SIGKILLed behind vLLM's router (vllm-router 0.1.17, a dev dependency; issue 36),
with requests in flight on it: what each client sees, that the survivor then serves everything,
and that the replica-down alert names the dead replica.

What vllm-router 0.1.17 does (src/routers/http/router.rs, send_typed_request): it forwards a
stream's bytes as they come; when the upstream body fails mid-stream it hands the error to its
HTTP server as a body error, and hyper closes the client's connection without the chunked
body's last chunk. The 200 head is already out, so there is no error status and no SSE error
event (no option changes that): the client raises (httpx.RemoteProtocolError "incomplete chunked
read"; the openai package, openai.APIConnectionError caused by it), and the stream has neither
a chunk with a finish_reason nor `data: [DONE]`, which every whole stream of ours has. A request
whose response head had not left the replica (a whole, non-streamed one) fails to send in the
router, which retries it on the other replica (--retry-max-retries): the client gets a 200.

Two real replicas on the tiny model behind the real router (round_robin, bench/replicas.py's
failover flags, as deployed). The replica to die (B) is frozen (SIGSTOP on its engine core)
once its streams have tokens, so each of its requests is still in flight when it is killed,
whatever this machine's speed."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.chat_workload import Turn, chat_turn
from bench.harness import decode_sse, wait_until
from bench.replicas import ROUTER, replicas

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing"),
]
ROOT = Path(__file__).resolve().parents[2]
ALERT_RULES = ROOT / "deploy" / "prometheus" / "rules" / "moeserve-alerts.rules.yml"
SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2100", "--max-num-seqs", "4"]
SERVE += ["--kv-cache-tokens", "8192"]
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
# B's streams: far more tokens than it makes between their first token and its freezing
LONG = 2000
SHORT = 32  # A's streams: they only have to run beside the kill
WHOLE = 16


class Call:
    """One request through the router on a thread of its own: what the client saw."""

    def __init__(self, rid: str, run: Callable[[Call], None]) -> None:
        self.rid = rid
        self.first_token = threading.Event()
        self.status: int | None = None
        self.events: list[dict] = []  # the streamed chunks that arrived
        self.done = False  # `data: [DONE]` arrived
        self.finish_reason: str | None = None
        self.body: dict | None = None  # a whole response's JSON
        self.error: BaseException | None = None
        self.turn: Turn | None = None  # the bench's record of it (bench_stream)
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self._thread.start()

    def _main(self, run: Callable[[Call], None]) -> None:
        try:
            run(self)
        except Exception as exc:  # noqa: BLE001 - what the client raised is the finding
            self.error = exc
        finally:
            self.first_token.set()

    def join(self) -> None:
        self._thread.join(180)
        assert not self._thread.is_alive(), f"{self.rid} still running"

    def saw(self, chunk: dict) -> None:
        self.events.append(chunk)
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                self.first_token.set()
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def raw_stream(url: str, model: str, tokens: int = SHORT) -> Callable[[Call], None]:
    def run(call: Call) -> None:
        body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "stream": True}
        headers = {"x-request-id": call.rid}
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**body, "ignore_eos": True},
            headers=headers, timeout=120,
        ) as response:  # fmt: skip
            call.status = response.status_code
            for line in response.iter_lines():
                if line:
                    event = decode_sse(line)
                    call.done = event is None
                    if event is not None:
                        call.saw(event)

    return run


def openai_stream(url: str, model: str, tokens: int = SHORT) -> Callable[[Call], None]:
    def run(call: Call) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"x-request-id": call.rid},
        )  # fmt: skip
        for chunk in stream:
            call.saw(chunk.model_dump())

    return run


def bench_stream(url: str, model: str, tokens: int = SHORT) -> Callable[[Call], None]:
    """The stream as replicas_bench's kill run sends and classifies it (chat_workload)."""

    def run(call: Call) -> None:
        call.turn = Turn(0, 0, call.rid, url, sent=0.0)
        body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}

        async def go() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                turn = asyncio.ensure_future(
                    chat_turn(client, url, body, call.turn, time.perf_counter())
                )
                while not turn.done():
                    if call.turn.got_tokens:
                        call.first_token.set()
                    await asyncio.sleep(0.01)
                await turn

        asyncio.run(go())

    return run


def whole(url: str, model: str) -> Callable[[Call], None]:
    def run(call: Call) -> None:
        body = {"model": model, "messages": MESSAGES, "max_tokens": WHOLE, "ignore_eos": True}
        headers = {"x-request-id": call.rid}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        call.status = response.status_code
        call.body = response.json()

    return run


def inspected(url: str, in_progress: bool = False) -> set[str]:
    """The request ids a replica's inspector lists (only those still in progress)."""
    requests = httpx.get(url + "/inspect/api/requests", timeout=10).json()["requests"]
    return {r["request_id"] for r in requests if r["outcome"] == "in_progress" or not in_progress}


def worker_health(metrics_url: str) -> dict[str, float]:
    """The router's vllm_router_worker_health gauge: worker URL -> 1 (healthy) or 0."""
    text = httpx.get(metrics_url, timeout=10).text
    return {
        s.labels["worker"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm_router_worker_health"
    }


@pytest.fixture(scope="module")
def killed(tiny_model_dir):
    """Eight requests through the router, four on each replica (a raw httpx stream, an openai
    stream, the bench's stream, a whole request), then replica B killed with its four in flight;
    returns what every client saw and what the router said afterwards."""
    with ExitStack() as stack:
        cluster = stack.enter_context(
            replicas(str(tiny_model_dir), 2, "round_robin", serve_args=SERVE)
        )
        urls = [r.server.url for r in cluster.replicas]
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        calls: dict[str, Call] = {}
        placed: dict[str, str] = {}  # request id -> the replica's URL

        def send(rid: str, run: Callable[[Call], None], first_token: bool = False) -> None:
            calls[rid] = Call(rid, run)
            # round robin alternates: each request is on its replica before the next is sent
            placed[rid] = wait_until(
                lambda: next((u for u in urls if rid in inspected(u)), None), 60, rid
            )
            if first_token:
                assert calls[rid].first_token.wait(60), rid

        send("a-raw-stream", raw_stream(cluster.url, model))
        a = placed["a-raw-stream"]
        b = next(u for u in urls if u != a)
        doomed = cluster.replicas[urls.index(b)].server
        send("b-openai-stream", openai_stream(cluster.url, model, LONG), first_token=True)
        send("a-openai-stream", openai_stream(cluster.url, model))
        send("b-raw-stream", raw_stream(cluster.url, model, LONG), first_token=True)
        send("a-bench-stream", bench_stream(cluster.url, model))
        send("b-bench-stream", bench_stream(cluster.url, model, LONG), first_token=True)
        core = doomed.engine_core_pid()
        os.kill(core, signal.SIGSTOP)  # B generates nothing more: its requests stay in flight
        send("a-whole", whole(cluster.url, model))
        send("b-whole", whole(cluster.url, model))
        assert placed == {rid: (a if rid.startswith("a-") else b) for rid in calls}, placed
        on_b = inspected(b, in_progress=True)
        for pid in (doomed.pid, core):
            os.kill(pid, signal.SIGKILL)
        for call in calls.values():
            call.join()

        after = []  # the survivor carries everything from here
        for i in range(6):
            rid = f"after-{i}"
            call = Call(rid, (raw_stream if i % 2 else whole)(cluster.url, model))
            call.join()
            after.append(call)
        health = wait_until(
            lambda: (h := worker_health(cluster.router_metrics)).get(b) == 0 and h,
            60,
            "the router's health check marking the dead replica",
        )
        yield {
            "calls": calls, "on_b": on_b, "a": a, "b": b, "after": after, "health": health,
            "served_by_a": inspected(a),
        }  # fmt: skip


def test_streams_in_flight_on_the_dead_replica_end_in_an_error_the_client_raises(killed):
    calls = killed["calls"]
    assert {"b-openai-stream", "b-raw-stream", "b-bench-stream", "b-whole"} <= killed["on_b"]
    raw = calls["b-raw-stream"]
    # the head (200) had gone out; the router then closed the connection mid-body
    assert raw.status == 200 and raw.events, "tokens arrived before the kill"
    assert isinstance(raw.error, httpx.RemoteProtocolError), repr(raw.error)
    assert "incomplete chunked read" in str(raw.error)
    # and the framing says so too: no finish_reason, no [DONE]
    assert raw.finish_reason is None and not raw.done
    sdk = calls["b-openai-stream"]
    assert isinstance(sdk.error, openai.APIConnectionError), repr(sdk.error)
    cause = sdk.error.__cause__
    assert type(cause).__name__ == "RemoteProtocolError" and "incomplete chunked read" in str(
        cause
    ), repr(cause)
    assert sdk.events and sdk.finish_reason is None
    # replicas_bench's kill run records such a stream as aborted, by the client's exception
    turn = calls["b-bench-stream"].turn
    assert (turn.outcome, turn.exception, turn.status) == (
        "aborted", "httpx.RemoteProtocolError", 200,
    ), turn  # fmt: skip
    assert turn.got_tokens and turn.finish_reason is None and not turn.done


def test_a_whole_request_in_flight_on_the_dead_replica_is_retried_on_the_survivor(killed):
    retried = killed["calls"]["b-whole"]
    assert retried.error is None and retried.status == 200, (retried.error, retried.body)
    assert retried.body["usage"]["completion_tokens"] == WHOLE
    assert "b-whole" in killed["served_by_a"]  # the router sent it again, to A


def test_the_survivors_requests_and_every_later_one_succeed(killed):
    calls = killed["calls"]
    for rid in ("a-raw-stream", "a-openai-stream"):
        call = calls[rid]
        assert call.error is None and call.finish_reason == "length", (rid, call.error)
    assert calls["a-raw-stream"].done
    turn = calls["a-bench-stream"].turn
    assert turn.ok and turn.done and turn.finish_reason == "length", turn
    assert calls["a-whole"].status == 200
    for call in killed["after"]:
        assert call.error is None and call.status == 200, (call.rid, call.error, call.body)
        if call.body is None:  # a stream: whole, to its finish_reason and [DONE]
            assert call.done and call.finish_reason is not None, call.rid
    assert killed["after"][-1].rid in killed["served_by_a"]


def test_the_replica_down_alert_names_the_dead_replica(killed, tmp_path):
    """The router's own gauge for the dead replica, as scraped, fed to the real
    MoeserveReplicaDown rule (promtool): the alert carries the replica's host:port."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus); check not run")
    health, b = killed["health"], killed["b"]
    assert health == {killed["a"]: 1, b: 0}
    series = [
        {"series": f'vllm_router_worker_health{{job="vllm-router",worker="{url}"}}',
         "values": f"{int(value)}x10"}
        for url, value in health.items()
    ]  # fmt: skip
    instance = urlsplit(b).netloc
    cases = {
        "rule_files": [str(ALERT_RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "alertname": "MoeserveReplicaDown",
                        "eval_time": "5m",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "critical", "service": "moeserve",
                                    "worker": b, "instance": instance,
                                },
                                "exp_annotations": {
                                    "summary": f"Replica {instance} is out of the router's"
                                    " rotation",
                                    "description": f"The router has found replica {b} unhealthy"
                                    " for 1 minute and sends it no requests; the other"
                                    " replicas carry its share.",
                                    "runbook_url": "deploy/prometheus/runbooks.md"
                                    "#moeservereplicadown",
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "replica-down.test.yml"
    path.write_text(yaml.safe_dump(cases))
    out = subprocess.run(
        ["promtool", "test", "rules", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
