"""Client disconnects abort their requests; SIGTERM drains gracefully and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from bench.harness import ServerProcess, SseError, iter_sse

LONG = {"prompt": "once upon a time", "max_tokens": 230, "ignore_eos": True, "temperature": 0}


def _aborted_since(server, mark: int) -> list[str]:
    """Engine request ids finished as "abort" since `mark`. The engine reports aborts with the
    next step's stats, so one tiny request runs first to produce a step."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    return [rid for rid, reason in server.finished[mark:] if reason == "abort"]


def test_stream_disconnect_aborts_and_frees_kv_blocks(server, wait_idle):
    mark = len(server.finished)
    with (
        httpx.Client(base_url=server.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        events = iter_sse(r.iter_lines())
        request_id = next(events)[1]["id"]
        for _ in range(4):
            next(events)
        assert server.engine.kv_blocks_used > 0  # it is running
    # leaving both `with` blocks closed the connection mid-stream
    elapsed = wait_idle(server, 2.0)
    assert elapsed < 2.0
    assert request_id in _aborted_since(server, mark)


def test_non_streaming_disconnect_aborts_the_request(server, wait_idle):
    """The client hangs up once its request is running (a read timeout would race a fast machine:
    CI generated all 230 tokens in 0.27 s once)."""
    mark = len(server.finished)
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.server.rest_port), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while server.engine.kv_blocks_used == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.001)
    wait_idle(server, 2.0)
    aborted = _aborted_since(server, mark)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-"), server.finished[mark:]


def test_disconnected_client_does_not_disturb_others(server, wait_idle):
    """One client leaving mid-stream; a concurrent request still completes normally."""
    result: dict = {}

    def other() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            result["r"] = c.post(
                "/v1/completions", json={"prompt": "abc", "max_tokens": 20, "ignore_eos": True}
            )

    t = threading.Thread(target=other)
    with (
        httpx.Client(base_url=server.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        t.start()
        next(iter_sse(r.iter_lines()))
    t.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 20
    wait_idle(server, 2.0)


def _stream_until_done(url: str, out: dict, key: int, started: threading.Event, body: dict) -> None:
    """Streams to the end: `out[key]` are the events, `out[f"error{key}"]` says what broke
    (a transport error, or a stream that did not end with data: [DONE])."""
    events = []
    try:
        with (
            httpx.Client(base_url=url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            out[f"status{key}"] = r.status_code
            for _, event in iter_sse(r.iter_lines()):
                events.append(event)
                started.set()
    except (httpx.HTTPError, SseError) as exc:
        out[f"error{key}"] = repr(exc)
    out[key] = events


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--max-model-len", "2048", "--kv-cache-tokens", "8192", "--dtype", "float32",
        "--drain-timeout", "60",
        grpc=True,
        start_timeout=120,
    ) as srv:  # fmt: skip
        started = srv.started
        url = srv.url
        assert isinstance(started["grpc_port"], int) and started["grpc_port"] > 0
        socket.create_connection(
            ("127.0.0.1", started["grpc_port"]), timeout=5
        ).close()  # gRPC listens too

        # long enough (seconds even on a fast machine) that the drain window is always observable
        body = {**LONG, "max_tokens": 1500}
        out: dict = {}
        flags = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=_stream_until_done, args=(url, out, i, flags[i], body))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in flags), out
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_for_event("draining", 10)

        with httpx.Client(base_url=url, timeout=10) as c:
            try:
                ready = c.get("/ready")
                new = c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            except httpx.TransportError:  # the streams may already be done and the server gone
                ready = new = None
        if ready is not None:
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            assert new.status_code == 503 and new.json()["error"]["code"] == "draining"
            assert new.headers.get("x-request-id")

        for t in threads:
            t.join(120)
        for i in range(2):
            assert out.get(f"status{i}") == 200 and f"error{i}" not in out, out
            finals = out[i]  # the stream ended with data: [DONE] (else error{i} is in out)
            assert finals[-1]["choices"][0]["finish_reason"] == "length"
            assert "".join(f["choices"][0]["text"] for f in finals)  # text arrived
        assert srv.proc.wait(60) == 0
        assert ready is not None, "drain window was too short to observe /ready 503"
        srv.wait_for_event("server stopped", 5)


def test_engine_core_death_fails_streams_and_turns_ready_503(start_server):
    """The engine core process dies mid-stream (e.g. the OOM killer): the stream ends with an
    error event; /ready, /health and new requests answer 503 engine_dead, nothing hangs."""
    with start_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            stream = iter_sse(r.iter_lines())
            next(stream)
            os.kill(srv.engine._process.pid, signal.SIGKILL)
            events = [event for _, event in stream]  # to data: [DONE]
        assert events and events[-1]["error"]["code"] == "engine_dead", events[-3:]
        ready = c.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "engine_dead"
        late = c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        health = c.get("/health")  # liveness fails: the orchestrator restarts the server
        assert health.status_code == 503 and health.json() == {
            "status": "engine_dead",
            "engine_alive": False,
        }


def test_engine_core_death_exits_the_server_for_its_supervisor(tiny_model_dir):
    """With its engine core gone the server cannot serve again: after a short window of
    503s it exits with EXIT_ENGINE_DEAD, so that docker compose (`restart: unless-stopped`)
    or Kubernetes starts a fresh one; the compose healthcheck alone would never restart it."""
    from service.server import ENGINE_DEAD_EXIT_DELAY_S, EXIT_ENGINE_DEAD

    with ServerProcess(
        tiny_model_dir, "--device", "cpu", "--dtype", "float32", stop_timeout=15
    ) as srv:
        core = srv.engine_core_pid()
        assert core is not None
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        health = None
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            while time.monotonic() - killed < ENGINE_DEAD_EXIT_DELAY_S:
                try:
                    health = c.get("/health")
                except httpx.TransportError:
                    break
                if health.status_code == 503:
                    break
                time.sleep(0.05)
        assert health is not None and health.status_code == 503, health
        assert srv.proc.wait(30) == EXIT_ENGINE_DEAD
        assert time.monotonic() - killed >= ENGINE_DEAD_EXIT_DELAY_S - 0.5
        srv.wait_for_event("engine core died; exiting so that the supervisor restarts the server")
