"""bench/harness.py on its own: the SSE reader's framing rules and the process harness's
start, log capture, readiness failures and bounded stop (no model needed)."""

from __future__ import annotations

import os
import sys
import time

import httpx
import pytest

from bench.harness import (
    ManagedProcess,
    ServerProcess,
    SseError,
    _server_env,
    aiter_sse,
    iter_sse,
    read_sse,
    wait_for_http,
)

GOOD = ['data: {"id": 1}', "", 'data: {"id": 2}', "", "data: [DONE]", ""]


def test_iter_sse_yields_events_with_arrival_times_up_to_done():
    got = list(iter_sse(GOOD))
    assert [e for _, e in got] == [{"id": 1}, {"id": 2}]
    assert got[0][0] <= got[1][0] <= time.perf_counter()


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['data: {"id": 1}'], "without data: \\[DONE\\]"),
        (["data: [DONE]", 'data: {"id": 1}'], "after data: \\[DONE\\]"),
        (["event: x", "data: [DONE]"], "not an SSE data line"),
        (['data:{"id": 1}', "data: [DONE]"], "not an SSE data line"),
        (["data: [1, 2]", "data: [DONE]"], "not a JSON object"),
        (["data: {oops", "data: [DONE]"], "not JSON"),
    ],
)
def test_iter_sse_rejects_broken_streams(lines, match):
    with pytest.raises(SseError, match=match):
        list(iter_sse(lines))


async def test_aiter_sse_reads_the_same_framing():
    async def lines():
        for line in GOOD:
            yield line

    assert [e async for _, e in aiter_sse(lines())] == [{"id": 1}, {"id": 2}]

    async def cut():
        yield 'data: {"id": 1}'

    with pytest.raises(SseError):
        [e async for e in aiter_sse(cut())]


def test_read_sse_reads_an_httpx_stream():
    body = "\n".join(GOOD).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    with httpx.Client(transport=transport) as client, client.stream("GET", "http://x/") as r:
        assert read_sse(r) == [{"id": 1}, {"id": 2}]


def test_stop_kills_what_ignores_sigterm_and_keeps_the_log():
    script = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = ManagedProcess([sys.executable, "-c", script], stop_timeout=0.5).start()
    deadline = time.monotonic() + 20
    while "up" not in proc.log_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.log_text()
        time.sleep(0.05)
    start = time.monotonic()
    assert proc.stop() == -9
    assert time.monotonic() - start < 5
    assert proc.lines == ["up\n"] and not proc.log_path.exists()  # its temporary log is gone
    assert proc.stop() == -9  # twice is fine


def test_wait_for_http_fails_with_the_log_when_the_process_exits():
    script = "print('no server here', flush=True)"
    with (
        ManagedProcess([sys.executable, "-c", script]) as proc,
        pytest.raises(RuntimeError, match="no server here"),
    ):
        wait_for_http("http://127.0.0.1:9/", 20, process=proc)


def test_server_env_drops_inherited_flag_variables(monkeypatch):
    monkeypatch.setenv("MOESERVE_PORT", "1234")
    monkeypatch.setenv("MOESERVE_CACHE_DIR", "/somewhere")  # not a flag: kept
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x")
    env = _server_env({"MOESERVE_TELEMETRY": "0", "OTEL_EXPORTER_OTLP_ENDPOINT": None})
    assert "MOESERVE_PORT" not in env and env["MOESERVE_CACHE_DIR"] == "/somewhere"
    assert env["MOESERVE_TELEMETRY"] == "0" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert env["PATH"] == os.environ["PATH"]


def test_a_server_that_cannot_start_fails_with_its_log_tail(tmp_path):
    server = ServerProcess(tmp_path / "no-such-model", start_timeout=120)
    with pytest.raises(AssertionError, match=r"exited \(\d+\)") as info:
        server.__enter__()
    assert "no-such-model" in str(info.value)  # the server's own error, from its log
    assert server.poll() is not None
