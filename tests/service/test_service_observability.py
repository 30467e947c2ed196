"""Request telemetry inside the service (in-process servers): outcomes in requests_total,
the summary line with and without --log-prompts, telemetry switched off, a Generation on a
span its caller opened, and a constrained request's count, compile histogram and span."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from inference import SamplingParams, StructuredOutputs
from service.generation import Generation
from service.observability import Observability
from service.state import ServingState
from service.validation import GenerationInput
from telemetry.metrics import ServiceMetrics

COMP = "/v1/completions"


def _summaries(logs: list[dict]) -> list[dict]:
    return [r for r in logs if r.get("event") == "request finished"]


def _requests_total(srv, **labels) -> float:
    metrics = srv.state.observability.metrics
    labels = {"model": srv.state.model_name, "api": "rest", "key": "none", **labels}
    return metrics.registry.get_sample_value("moeserve_requests_total", labels) or 0.0


def test_summary_line_has_no_text_without_log_prompts(server, http):
    with capture_logs() as logs:
        r = http.post(
            COMP,
            # ignore_eos: a sampled EOS (1 in the vocabulary's size a token) would end it early
            json={"prompt": "secret prompt", "max_tokens": 3, "ignore_eos": True},
            headers={"x-request-id": "no-text-1"},
        )
        assert r.status_code == 200
    (line,) = [s for s in _summaries(logs) if s["request_id"] == "no-text-1"]
    assert line["status"] == "ok" and line["completion_tokens"] == 3 and line["api"] == "rest"
    assert "prompt" not in line and "output" not in line
    assert "secret prompt" not in repr(logs)


def test_refused_bodies_count_as_client_errors(server, http):
    """Bodies Litestar refuses itself (over the limit: 413; empty: 400) and a client leaving
    in the middle of its body are the client's doing: requests_total{status="client_error"},
    never server_error (that would page MoeserveHighErrorRatio on malformed traffic)."""
    labels = {"finish_reason": "none"}
    before = {
        s: _requests_total(server, status=s, **labels) for s in ("client_error", "server_error")
    }
    limit = server.settings.max_body_bytes
    assert http.post(COMP, json={"prompt": "x" * (limit + 10)}).status_code == 413
    empty = http.post(COMP, content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400
    body = b'{"prompt": "hi", "max_tokens": 2}'
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.server.rest_port), timeout=10) as sock:
        sock.sendall(head + body)  # 100 bytes short, then gone
    deadline = time.monotonic() + 10
    while _requests_total(server, status="client_error", **labels) < before["client_error"] + 3:
        assert time.monotonic() < deadline, "the short body was not counted"
        time.sleep(0.02)
    assert _requests_total(server, status="server_error", **labels) == before["server_error"]


def test_log_prompts_adds_prompt_and_output_text(start_server):
    with start_server(log_prompts=True) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with capture_logs() as logs:
            r = http.post(
                COMP,
                json={"prompt": "tell me", "max_tokens": 3},
                headers={"x-request-id": "with-text-1"},
            )
        (line,) = [s for s in _summaries(logs) if s["request_id"] == "with-text-1"]
        assert "tell me" in line["prompt"] and line["output"] == r.json()["choices"][0]["text"]


def test_outcomes_are_counted_once_per_request(server, http):
    before = {
        s: _requests_total(server, status=s, finish_reason=f)
        for s, f in (("ok", "length"), ("client_error", "none"))
    }
    assert http.post(COMP, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert (
        http.post(COMP, json={"prompt": "hi", "max_tokens": 0}).status_code == 400
    )  # Litestar-side
    assert (
        http.post(COMP, json={"prompt": "hi", "max_tokens": 10_000}).status_code == 400
    )  # engine-side
    assert http.post(COMP, json={"prompt": "hi", "model": "nope"}).status_code == 404
    assert _requests_total(server, status="ok", finish_reason="length") == before["ok"] + 1
    assert (
        _requests_total(server, status="client_error", finish_reason="none")
        == before["client_error"] + 3
    )


@pytest.mark.slow
def test_queue_full_counts_as_rejected(start_server):
    with start_server(max_waiting=1, max_num_seqs=1) as srv:

        async def fire() -> list[int]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                body = {"prompt": "count to ten", "max_tokens": 64, "ignore_eos": True}
                return [
                    r.status_code
                    for r in await asyncio.gather(*(c.post(COMP, json=body) for _ in range(12)))
                ]

        with capture_logs() as logs:
            statuses = asyncio.run(asyncio.wait_for(fire(), 90))
        assert statuses.count(429) >= 1
        assert _requests_total(srv, status="rejected", finish_reason="none") == statuses.count(429)
        assert _requests_total(srv, status="ok", finish_reason="length") == statuses.count(200)
        rejected = [s for s in _summaries(logs) if s["status"] == "rejected"]
        assert len(rejected) == statuses.count(429)


def test_telemetry_off_serves_without_spans_metrics_or_request_logs(start_server):
    with start_server(telemetry=False) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with capture_logs() as logs:
            r = http.post(
                COMP,
                json={"prompt": "hi", "max_tokens": 2},
                headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
            )
        assert r.status_code == 200 and "traceparent" not in r.headers
        assert not _summaries(logs)
        assert http.get("/metrics").status_code == 404


def _observed(server):
    """A ServingState on the shared engine whose telemetry lands in memory: (span exporter,
    tracer provider, metrics, Observability, state)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = ServiceMetrics(CollectorRegistry(), "m", 1, 4, 8)
    obs = Observability("m", metrics=metrics, tracer=provider.get_tracer("t"))
    return (
        exporter,
        provider,
        metrics,
        obs,
        ServingState(server.engine, server.settings, "m", observability=obs),
    )


def test_generation_fills_the_span_it_is_given(server):
    """A Generation on a span its caller opened (as the transports do): phases under it,
    GenAI attributes on it, metrics and the summary line."""
    exporter, provider, metrics, obs, state = _observed(server)

    async def run() -> list:
        params = SamplingParams(max_tokens=3, n=2, ignore_eos=True)
        span = provider.get_tracer("t").start_span("server")
        gen = Generation(state, "rest", "direct-1", span)
        spec = GenerationInput([5, 6, 7], params, "text_completion", stream=False)
        updates = [u.output async for u in gen.updates(spec)]
        gen.finish()
        span.end()
        return updates

    with capture_logs() as logs:
        outputs = asyncio.run_coroutine_threadsafe(run(), server.loop).result(30)
    assert outputs[-1].finished
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["text_completion m"]
    assert {"queue", "prefill", "decode"} <= set(spans)
    assert spans["decode"].parent.span_id == request.context.span_id
    assert request.attributes["gen_ai.usage.output_tokens"] == 6  # n=2 samples of 3
    assert request.attributes["gen_ai.request.choice.count"] == 2
    assert (
        metrics.registry.get_sample_value(
            "moeserve_requests_total",
            {"model": "m", "api": "rest", "status": "ok", "finish_reason": "length", "key": "none"},
        )
        == 1
    )
    (line,) = [s for s in _summaries(logs) if s["request_id"] == "direct-1"]
    assert line["completion_tokens"] == 6 and line["trace_id"] == format(
        request.context.trace_id, "032x"
    )
    assert not obs.live  # the step-link map forgets finished requests


def test_a_constrained_request_is_counted_and_its_grammar_compile_traced(server):
    exporter, provider, metrics, _, state = _observed(server)
    constraint = StructuredOutputs(regex="[ab]{3}")

    async def run() -> str:
        span = provider.get_tracer("t").start_span("server")
        gen = Generation(state, "rest", "constrained-1", span)
        params = SamplingParams(max_tokens=5, structured_outputs=constraint)
        final = await gen.final(GenerationInput([5, 6, 7], params, "text_completion", False))
        gen.finish()
        span.end()
        return final.output.text

    text = asyncio.run_coroutine_threadsafe(run(), server.loop).result(30)
    assert len(text) == 3 and set(text) <= {"a", "b"}
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["text_completion m"]
    assert spans["grammar_compile"].parent.span_id == request.context.span_id
    sample = metrics.registry.get_sample_value
    assert sample("moeserve_structured_requests_total", {"model": "m", "kind": "regex"}) == 1
    compiled = [
        s.value
        for family in metrics.registry.collect()
        if family.name == "moeserve_grammar_compile_seconds"
        for s in family.samples
        if s.name.endswith("_count")
    ]
    assert sum(compiled) == 1


def _step(duration_s: float, prefill: int = 0, preemptions: int = 0):
    from inference.outputs import StepStats

    return StepStats(
        started=0.0,
        started_unix_ns=1,
        duration_s=duration_s,
        num_running=1,
        num_waiting=0,
        batch_size=1,
        num_prefill_tokens=prefill,
        num_decode_tokens=1 - bool(prefill),
        num_generated_tokens=1,
        kv_usage=0.1,
        kv_blocks_used=1,
        num_requests=1,
        num_preemptions=preemptions,
        request_ids=["r"],
    )


def test_step_spans_keep_unusual_steps_and_sample_routine_ones():
    from service.observability import ROUTINE_STEP_SPAN_EVERY

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    obs = Observability("m", tracer=provider.get_tracer("t"))

    def spans_for(stats) -> int:
        before = len(exporter.get_finished_spans())
        obs.on_step(stats)
        return len(exporter.get_finished_spans()) - before

    assert spans_for(_step(0.5, prefill=128)) == 1  # prefill: always
    routine = [spans_for(_step(0.010)) for _ in range(3 * ROUTINE_STEP_SPAN_EVERY)]
    assert sum(routine) == 3 and routine[0] == 1  # one routine decode step in N
    assert spans_for(_step(0.010, preemptions=1)) == 1  # preemption: always
    assert spans_for(_step(0.050)) == 1  # 5x the typical decode step: slow, always
    assert all(s.name == "engine_step" for s in exporter.get_finished_spans())
