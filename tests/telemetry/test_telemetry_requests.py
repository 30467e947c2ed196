from __future__ import annotations

import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from telemetry.logging import bind_request_context
from telemetry.metrics import ServiceMetrics, render_metrics
from telemetry.requests import finish_request, merged_times


def test_finish_request_spans_metrics_and_summary_line(log_stream, tracer, span_exporter):
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "tiny-moe", 1, 2, 8)
    times = SimpleNamespace(arrival=1.0, first_scheduled=1.1, first_token=1.3, last_token=2.3,
                            finished=2.3, num_preemptions=0)  # fmt: skip
    bind_request_context("req-9", api="rest")
    with tracer.start_as_current_span("POST /v1/chat/completions") as span:
        lat = finish_request(
            span, api="rest", request_id="req-9", times=times, num_prompt_tokens=4,
            num_output_tokens=11, finish_reason="length", metrics=metrics, response_id="chatcmpl-9",
            tracer=tracer,
        )  # fmt: skip
    assert round(lat.tpot, 6) == 0.1
    trace_id = format(span.get_span_context().trace_id, "032x")

    (line,) = [json.loads(x) for x in log_stream.getvalue().splitlines()]
    assert line["event"] == "request finished"
    assert line["request_id"] == "req-9" and line["api"] == "rest"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (4, 11)
    assert (line["ttft_ms"], line["tpot_ms"], line["e2e_ms"]) == (300.0, 100.0, 1300.0)
    assert (line["finish_reason"], line["status"], line["trace_id"]) == ("length", "ok", trace_id)

    finished = {s.name: s for s in span_exporter.get_finished_spans()}
    assert {"queue", "prefill", "decode"} <= set(finished)
    attrs = finished["POST /v1/chat/completions"].attributes
    assert attrs["gen_ai.usage.output_tokens"] == 11
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.response.id"] == "chatcmpl-9"

    body, _ = render_metrics(registry, "application/openmetrics-text")
    assert f'trace_id="{trace_id}"' in body.decode()


def test_a_constrained_request_gets_a_grammar_compile_span_and_histogram(
    log_stream, tracer, span_exporter
):
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "tiny-moe", 1, 2, 8)
    times = SimpleNamespace(arrival=1.0, first_scheduled=1.1, first_token=1.3, last_token=2.3,
                            finished=2.3, num_preemptions=0, grammar_compile_s=0.004,
                            grammar_cache_hit=False)  # fmt: skip
    with tracer.start_as_current_span("POST /v1/chat/completions") as span:
        finish_request(
            span, api="rest", request_id="req-g", times=times, num_prompt_tokens=4,
            num_output_tokens=11, finish_reason="stop", metrics=metrics, tracer=tracer,
        )  # fmt: skip
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    compile_span = spans["grammar_compile"]
    assert compile_span.parent.span_id == span.get_span_context().span_id
    assert compile_span.end_time - compile_span.start_time == 4_000_000
    assert compile_span.start_time == spans["queue"].start_time  # from arrival
    assert compile_span.attributes["moeserve.grammar.cache_hit"] is False
    body, _ = render_metrics(registry)
    text = body.decode()
    assert 'moeserve_grammar_compile_seconds_count{cache="miss",model="tiny-moe"} 1.0' in text
    assert 'moeserve_grammar_compile_seconds_count{cache="hit",model="tiny-moe"} 0.0' in text

    # an unconstrained request: no compile span, nothing observed
    span_exporter.clear()
    plain = SimpleNamespace(**{**vars(times), "grammar_compile_s": None, "grammar_cache_hit": None})
    with tracer.start_as_current_span("POST /v1/completions") as span:
        finish_request(
            span, api="rest", request_id="req-p", times=plain, num_prompt_tokens=4,
            num_output_tokens=11, finish_reason="stop", metrics=metrics, tracer=tracer,
        )  # fmt: skip
    assert "grammar_compile" not in {s.name for s in span_exporter.get_finished_spans()}
    body, _ = render_metrics(registry)
    assert 'moeserve_grammar_compile_seconds_count{cache="miss",model="tiny-moe"} 1.0' in (
        body.decode()
    )


def test_merged_times_keep_the_grammar_compile():
    from inference.outputs import RequestTimes

    samples = [
        SimpleNamespace(times=RequestTimes(arrival=1.0, first_scheduled=1.1, first_token=1.2 + i,
                                           last_token=2.0 + i, finished=2.0 + i,
                                           grammar_compile_s=0.002, grammar_cache_hit=True))
        for i in range(2)
    ]  # fmt: skip
    merged = merged_times(samples)
    assert (merged.grammar_compile_s, merged.grammar_cache_hit) == (0.002, True)
    assert merged.finished == 3.0
    plain = [SimpleNamespace(times=RequestTimes(arrival=1.0)) for _ in range(2)]
    assert merged_times(plain).grammar_compile_s is None
