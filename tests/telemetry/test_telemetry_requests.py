from __future__ import annotations

import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from telemetry.logging import bind_request_context
from telemetry.metrics import ServiceMetrics, render_metrics
from telemetry.requests import finish_request


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
