from __future__ import annotations

import re
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc.aio
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from bench.harness import free_port
from telemetry import tracing
from telemetry.tracing import (
    build_tracer_provider,
    extract_context,
    genai_request_attributes,
    genai_response_attributes,
    inject_carrier,
    inject_traceparent,
    monotonic_to_unix_converter,
    record_request_phases,
    record_step_span,
)

OTEL_VARS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)


def _exporters(provider):
    """The exporters the provider's processors feed (inside the export-counting wrapper)."""
    exporters = [p.span_exporter for p in provider._active_span_processor._span_processors]
    return [getattr(e, "inner", e) for e in exporters]


def _times(**kw):
    base = {
        "arrival": 100.0,
        "first_scheduled": 100.25,
        "first_token": 100.75,
        "last_token": 101.5,
        "finished": 101.5,
        "num_preemptions": 2,
    }
    base.update(kw)
    return SimpleNamespace(**base)


def _ns(t: float) -> int:
    return round(t * 1e9)


# ------------------------------------------------------------------ provider set-up


def test_no_exporter_by_default_but_spans_still_record():
    provider = build_tracer_provider()
    assert _exporters(provider) == []
    assert provider.resource.attributes["service.name"] == "moeserve"
    with provider.get_tracer("t").start_as_current_span("x") as span:
        assert span.is_recording()
        assert span.get_span_context().is_valid
    provider.shutdown()


def test_endpoint_implies_otlp_grpc(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc-from-env")
    provider = build_tracer_provider()
    (exporter,) = _exporters(provider)
    assert isinstance(exporter, GrpcExporter)
    assert provider.resource.attributes["service.name"] == "svc-from-env"
    provider.shutdown()


@pytest.mark.parametrize(
    "var", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
)
def test_http_protobuf_protocol(monkeypatch, var):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(var, "http/protobuf")
    provider = build_tracer_provider()
    (exporter,) = _exporters(provider)
    assert isinstance(exporter, HttpExporter)
    provider.shutdown()


def test_console_and_none(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = build_tracer_provider()
    assert [type(e) for e in _exporters(provider)] == [ConsoleSpanExporter]
    provider.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert _exporters(build_tracer_provider()) == []


def test_bad_settings_fail_fast(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        build_tracer_provider()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        build_tracer_provider()


def test_configure_tracing_global_is_idempotent():
    code = (
        "from opentelemetry import trace\n"
        "from telemetry.tracing import configure_tracing, get_tracer, shutdown_tracing\n"
        "a = configure_tracing(); b = configure_tracing()\n"
        "assert a is b and trace.get_tracer_provider() is a\n"
        "with get_tracer().start_as_current_span('x') as s: assert s.is_recording()\n"
        "assert shutdown_tracing(2.0)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# ------------------------------------------------------------------ propagation


def test_traceparent_extracted_and_continued(tracer):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    incoming = {"Traceparent": f"00-{trace_id}-{parent_id}-01", "x-other": "1"}
    with tracer.start_as_current_span("server", context=extract_context(incoming)) as span:
        ctx = span.get_span_context()
        assert format(ctx.trace_id, "032x") == trace_id
        assert span.parent.span_id == int(parent_id, 16)
        header = inject_traceparent(span)
        assert header == f"00-{trace_id}-{ctx.span_id:016x}-01"
        assert inject_carrier()["traceparent"] == header
    # gRPC metadata: (key, value) pairs, binary values ignored
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"), ("x-bin", b"\x00"))
    remote = trace.get_current_span(extract_context(metadata)).get_span_context()
    assert remote.trace_id == int(trace_id, 16) and remote.is_remote
    aio_metadata = grpc.aio.Metadata(*metadata)  # what grpc.aio's invocation_metadata() gives
    remote = trace.get_current_span(extract_context(aio_metadata)).get_span_context()
    assert remote.trace_id == int(trace_id, 16)


def test_invalid_or_missing_traceparent_starts_a_new_trace(tracer):
    ctx = extract_context({"traceparent": "garbage"})
    with tracer.start_as_current_span("server", context=ctx) as span:
        assert span.parent is None and span.get_span_context().is_valid
    assert inject_traceparent(trace.INVALID_SPAN) is None


def test_monotonic_to_unix_converter_tracks_wall_clock():
    assert abs(monotonic_to_unix_converter()(time.monotonic()) - time.time_ns()) < 50_000_000


def test_monotonic_to_unix_converter_follows_a_wall_clock_step(monkeypatch):
    """A CI machine's clock was stepped ~1 s mid-run; spans must follow the new wall clock."""
    real_time_ns = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + 5_000_000_000)
    assert abs(monotonic_to_unix_converter()(time.monotonic()) - time.time_ns()) < 50_000_000


# ------------------------------------------------------------------ request phases


def test_request_phase_spans(tracer, span_exporter):
    with tracer.start_as_current_span("POST /v1/completions") as parent:
        record_request_phases(parent, _times(), _ns, tracer=tracer)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert set(spans) == {"queue", "prefill", "decode", "POST /v1/completions"}
    parent_ctx = spans["POST /v1/completions"].context
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == parent_ctx.span_id
        assert spans[name].context.trace_id == parent_ctx.trace_id
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert (q.start_time, q.end_time) == (_ns(100.0), _ns(100.25))
    assert (p.start_time, p.end_time) == (_ns(100.25), _ns(100.75))
    assert (d.start_time, d.end_time) == (_ns(100.75), _ns(101.5))
    assert q.end_time <= p.start_time <= p.end_time <= d.start_time <= d.end_time
    (event,) = spans["POST /v1/completions"].events
    assert event.name == "first_token" and event.timestamp == _ns(100.75)
    assert spans["POST /v1/completions"].attributes["moeserve.request.num_preemptions"] == 2


def test_request_aborted_in_queue_gets_only_a_queue_span(tracer, span_exporter):
    with tracer.start_as_current_span("req") as parent:
        times = _times(first_scheduled=None, first_token=None, last_token=None, finished=100.5)
        record_request_phases(parent, times, _ns, tracer=tracer)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert set(spans) == {"queue", "req"}
    assert spans["queue"].end_time == _ns(100.5)
    assert spans["req"].events == ()


def test_phases_with_real_clock_default(tracer, span_exporter):
    now = time.monotonic()
    times = _times(
        arrival=now - 0.3,
        first_scheduled=now - 0.2,
        first_token=now - 0.1,
        last_token=now,
        finished=now,
    )
    with tracer.start_as_current_span("req") as parent:
        record_request_phases(parent, times, tracer=tracer)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert spans["queue"].start_time >= spans["req"].start_time - 400_000_000
    assert spans["decode"].end_time <= spans["req"].end_time + 50_000_000


# ------------------------------------------------------------------ engine steps


def _step(request_ids, started_unix_ns=1_700_000_000_000_000_000, duration_s=0.0125):
    return SimpleNamespace(
        started=0.0,
        started_unix_ns=started_unix_ns,
        duration_s=duration_s,
        num_running=3,
        num_waiting=1,
        batch_size=len(request_ids),
        num_prefill_tokens=17,
        num_decode_tokens=2,
        num_generated_tokens=3,
        kv_usage=0.5,
        num_preemptions=0,
        request_ids=request_ids,
        expert_tokens=None,
        finished=[],
    )


def test_step_span_links_to_request_spans(tracer, span_exporter):
    request_spans = {rid: tracer.start_span(f"req {rid}") for rid in ("a", "b", "c")}
    with tracer.start_as_current_span("unrelated current span"):
        step = record_step_span(
            _step(["a", "b", "c", "gone"]),
            lambda rid: request_spans[rid].get_span_context() if rid in request_spans else None,
            tracer=tracer,
        )
    for span in request_spans.values():
        span.end()
    (finished,) = [s for s in span_exporter.get_finished_spans() if s.name == "engine_step"]
    assert finished.context == step.get_span_context()
    assert finished.parent is None  # its own trace, not the current request's
    assert [link.context.span_id for link in finished.links] == [
        request_spans[r].get_span_context().span_id for r in ("a", "b", "c")
    ]
    assert finished.start_time == 1_700_000_000_000_000_000
    assert finished.end_time - finished.start_time == 12_500_000
    attrs = finished.attributes
    assert attrs["moeserve.engine.batch_size"] == 4
    assert attrs["moeserve.engine.num_prefill_tokens"] == 17
    assert attrs["moeserve.engine.kv_cache_usage"] == 0.5


def test_step_span_caps_links(tracer, span_exporter):
    ctx = tracer.start_span("r").get_span_context()
    record_step_span(
        _step([str(i) for i in range(300)]), lambda rid: ctx, tracer=tracer, max_links=128
    )
    (step,) = [s for s in span_exporter.get_finished_spans() if s.name == "engine_step"]
    assert len(step.links) == 128
    assert step.attributes["moeserve.engine.links_dropped"] == 172


# ------------------------------------------------------------------ GenAI attributes

DEPRECATED = {
    "gen_ai.system",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.prompt",
    "gen_ai.completion",
    "gen_ai.request.n",
}


def test_genai_attributes_current_names():
    req = genai_request_attributes(
        "chat",
        "tiny-moe",
        max_tokens=16,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        seed=1,
        choice_count=2,
        stream=True,
    )
    assert req == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "moeserve",
        "gen_ai.request.model": "tiny-moe",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 50.0,
        "gen_ai.request.seed": 1,
        "gen_ai.request.choice.count": 2,
        "gen_ai.request.stream": True,
    }
    minimal = genai_request_attributes("text_completion", "m", top_k=-1)
    assert set(minimal) == {"gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model"}
    resp = genai_response_attributes(
        response_id="cmpl-1", finish_reasons=["stop", None], input_tokens=5, output_tokens=7
    )
    assert resp == {
        "gen_ai.response.id": "cmpl-1",
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 7,
    }
    assert not (set(req) | set(resp)) & DEPRECATED
    assert all(re.fullmatch(r"gen_ai\.[a-z_.]+", k) for k in {**req, **resp})


# ------------------------------------------------------------------ exporting


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_dead_collector_never_blocks_or_raises(monkeypatch, protocol):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    if protocol != "grpc":
        endpoint += "/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the abandoned export gives up soon
    tracing.configure_tracing(set_global=False)
    tracer = tracing.get_tracer()
    started = time.perf_counter()
    for i in range(1500):  # 6000 spans, more than the default queue (2048): excess dropped
        with tracer.start_as_current_span("burst", attributes={"i": i}) as parent:
            record_request_phases(parent, _times(), _ns, tracer=tracer)
    burst_s = time.perf_counter() - started
    print(f"burst {burst_s:.2f}s")
    assert burst_s < 3.0, burst_s  # recording only, never waiting on I/O
    started = time.perf_counter()
    tracing.shutdown_tracing(timeout_s=1.0)
    print(f"shutdown {time.perf_counter() - started:.2f}s")
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_receiver(monkeypatch, otlp_receiver, protocol):
    if protocol == "grpc":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_receiver.http_endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "moeserve-test")
    tracing.configure_tracing(set_global=False)
    tracer = tracing.get_tracer()
    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracer.start_as_current_span("server", context=extract_context(incoming)) as span:
        record_request_phases(span, _times(), _ns)
        span.set_attributes(genai_request_attributes("chat", "tiny-moe", max_tokens=4))
    record_step_span(_step(["r1"]), lambda rid: span.get_span_context())
    assert tracing.shutdown_tracing(timeout_s=10.0)
    spans = otlp_receiver.wait_for_spans(count=5, timeout=10.0)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"server", "queue", "prefill", "decode", "engine_step"}
    server = by_name["server"]
    assert server.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent_span_id == "b7ad6b7169203331"
    assert server.service_name == "moeserve-test"
    assert server.attributes["gen_ai.request.model"] == "tiny-moe"
    assert [e[0] for e in server.events] == ["first_token"]
    assert by_name["decode"].parent_span_id == server.span_id
    assert by_name["engine_step"].links == [(server.trace_id, server.span_id)]
    assert {via for via, _ in otlp_receiver.requests} == {protocol.split("/")[0]}


def test_spans_from_another_thread_keep_explicit_context(tracer, span_exporter):
    """The engine thread has no contextvars: it passes span contexts explicitly."""
    import threading

    parent = tracer.start_span("req")
    token_ctx = trace.set_span_in_context(parent)
    done = threading.Event()

    def engine():
        assert not trace.get_current_span().get_span_context().is_valid
        tracer.start_span("child", context=token_ctx).end()
        done.set()

    threading.Thread(target=engine).start()
    assert done.wait(5)
    parent.end()
    child = next(s for s in span_exporter.get_finished_spans() if s.name == "child")
    assert child.parent.span_id == parent.get_span_context().span_id


def test_step_span_carries_the_bitmask_cost_when_there_was_one(tracer, span_exporter):
    record_step_span(_step(["a"]), lambda rid: None, tracer=tracer)  # no bitmask_s at all
    plain = SimpleNamespace(**{**vars(_step(["b"])), "bitmask_s": 0.0})
    record_step_span(plain, lambda rid: None, tracer=tracer)
    masked = SimpleNamespace(**{**vars(_step(["c"])), "bitmask_s": 0.0007})
    record_step_span(masked, lambda rid: None, tracer=tracer)
    first, second, third = span_exporter.get_finished_spans()
    assert "moeserve.step.bitmask_s" not in first.attributes
    assert "moeserve.step.bitmask_s" not in second.attributes
    assert third.attributes["moeserve.step.bitmask_s"] == 0.0007


def test_grammar_compile_phase_span(tracer, span_exporter):
    with tracer.start_as_current_span("req") as parent:
        times = _times(grammar_compile_s=0.125, grammar_cache_hit=True)
        record_request_phases(parent, times, _ns, tracer=tracer)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert set(spans) == {"grammar_compile", "queue", "prefill", "decode", "req"}
    g = spans["grammar_compile"]
    assert (g.start_time, g.end_time) == (_ns(100.0), _ns(100.125))
    assert g.parent.span_id == spans["req"].context.span_id
    assert g.attributes["moeserve.grammar.cache_hit"] is True
