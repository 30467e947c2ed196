"""Telemetry wired into both APIs, end to end: a real `moeserve serve` subprocess exporting
spans over OTLP/gRPC to an in-process receiver, its JSON logs captured from stdout.

Requests carry a known W3C traceparent; the tests check the server span continues it and
is returned, the queue/prefill/decode children and the first_token event, the GenAI
attributes (current names), step spans linking to request spans, and that every log line of
a request (engine-thread lines included) carries the exported span's trace_id/span_id.
"""

from __future__ import annotations

import secrets
import socket
import threading

import httpx
import pytest
from e2e_support import OtlpReceiver, ReceivedSpan, Service

from bench.harness import iter_sse
from service.proto.moeserve.v1 import inference_pb2 as pb

SERVER, INTERNAL = 2, 1  # OTLP span kinds
ERROR = 2  # OTLP status code
SPEC_METRICS = (
    "moeserve_time_to_first_token_seconds", "moeserve_time_per_output_token_seconds",
    "moeserve_e2e_request_latency_seconds", "moeserve_request_queue_time_seconds",
    "moeserve_prompt_tokens_total", "moeserve_generation_tokens_total", "moeserve_requests_total",
    "moeserve_num_requests_running", "moeserve_num_requests_waiting",
    "moeserve_kv_cache_usage_ratio", "moeserve_batch_size", "moeserve_engine_step_seconds",
    "moeserve_preemptions_total", "moeserve_moe_expert_tokens_total",
    "moeserve_moe_expert_imbalance",
)  # fmt: skip
DEPRECATED = (
    "gen_ai.system",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.prompt",
    "gen_ai.completion",
)


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def service(tiny_model_dir, receiver):
    # A 128-token KV cache: two long requests at once cannot both fit, so one is preempted.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
    with Service(tiny_model_dir, "--kv-cache-tokens", "128", "--max-num-seqs", "4", env=env) as srv:
        yield srv  # srv.model: the served name, from its "server started" line


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def _returned(traceparent: str) -> tuple[str, str]:
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16
    assert int(flags, 16) & 1  # sampled (the SDK may add W3C level-2 flags, e.g. "random")
    return trace_id, span_id


def _check_request_trace(
    receiver: OtlpReceiver, span_id: str, trace_id: str, parent_id: str, operation: str, model: str
) -> ReceivedSpan:
    """The request's server span, its phase children and a step span linking to it."""
    server = receiver.wait_for_spans(lambda s: s.span_id == span_id)[0]
    assert server.trace_id == trace_id and server.parent_span_id == parent_id
    assert server.kind == SERVER and server.name == f"{operation} {model}"
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == operation and attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.provider.name"] == "moeserve"
    assert not set(DEPRECATED) & set(attrs)
    assert [e[0] for e in server.events].count("first_token") == 1
    children = receiver.wait_for_spans(lambda s: s.parent_span_id == span_id, count=3)
    by_name = {s.name: s for s in children}
    assert set(by_name) == {"queue", "prefill", "decode"}
    assert all(s.trace_id == trace_id and s.kind == INTERNAL for s in children)
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert server.start_unix_ns <= queue.start_unix_ns <= queue.end_unix_ns <= prefill.start_unix_ns
    assert prefill.end_unix_ns <= decode.start_unix_ns <= decode.end_unix_ns <= server.end_unix_ns
    first_token_ns = next(e[1] for e in server.events if e[0] == "first_token")
    assert first_token_ns == decode.start_unix_ns
    steps = receiver.wait_for_spans(
        lambda s: s.name == "engine_step" and (trace_id, span_id) in s.links
    )
    assert all(s.trace_id != trace_id and s.parent_span_id == "" for s in steps)  # steps are roots
    return server


def test_rest_request_continues_the_traceparent_with_phases_and_step_links(service, receiver):
    traceparent, trace_id, parent_id = _traceparent()
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "ignore_eos": True,
    }
    r = httpx.post(
        f"{service.url}/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"traceparent": traceparent, "x-request-id": "rest-trace-1"},
    )
    assert r.status_code == 200
    returned_trace, span_id = _returned(r.headers["traceparent"])
    assert returned_trace == trace_id and span_id != parent_id

    server = _check_request_trace(receiver, span_id, trace_id, parent_id, "chat", service.model)
    attrs = server.attributes
    usage = r.json()["usage"]
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9) and attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == r.json()["id"]
    assert (
        attrs["http.response.status_code"] == 200 and attrs["http.route"] == "/v1/chat/completions"
    )

    summary = service.summary("rest-trace-1")
    assert summary["trace_id"] == trace_id and summary["span_id"] == span_id
    assert summary["api"] == "rest" and summary["model"] == service.model
    assert summary["prompt_tokens"] == usage["prompt_tokens"] and summary["completion_tokens"] == 6
    assert summary["finish_reason"] == "length" and summary["status"] == "ok"
    assert (
        summary["ttft_ms"] > 0
        and summary["tpot_ms"] > 0
        and summary["e2e_ms"] >= summary["ttft_ms"]
    )
    assert "prompt" not in summary and "output" not in summary  # no --log-prompts


def test_grpc_request_continues_the_traceparent_with_phases_and_step_links(service, receiver):
    traceparent, trace_id, parent_id = _traceparent()
    request = pb.GenerateRequest(
        prompt="hello there",
        request_id="grpc-trace-1",
        params=pb.SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7),
    )
    call = service.stub.GenerateStream(request, metadata=[("traceparent", traceparent)], timeout=30)
    chunks = list(call)
    assert chunks[-1].finish_reason == "length"
    trailing = dict(call.trailing_metadata())
    returned_trace, span_id = _returned(trailing["traceparent"])
    assert returned_trace == trace_id

    server = _check_request_trace(
        receiver, span_id, trace_id, parent_id, "text_completion", service.model
    )
    attrs = server.attributes
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "GenerateStream"
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert (
        attrs["gen_ai.usage.output_tokens"] == 5 and attrs["gen_ai.response.id"] == "grpc-trace-1"
    )
    assert server.status_code != ERROR

    summary = service.summary("grpc-trace-1")
    assert (summary["trace_id"], summary["span_id"], summary["api"]) == (trace_id, span_id, "grpc")
    assert summary["completion_tokens"] == 5 and summary["status"] == "ok"


def test_bad_traceparent_starts_a_new_trace_and_the_request_succeeds(service, receiver):
    for bad in ("00-zzzz-bad-01", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"):
        r = httpx.post(
            f"{service.url}/v1/completions",
            timeout=30,
            headers={"traceparent": bad},
            json={"prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        trace_id, span_id = _returned(r.headers["traceparent"])
        assert trace_id != "0" * 32
        server = receiver.wait_for_spans(lambda s, span_id=span_id: s.span_id == span_id)[0]
        assert server.parent_span_id == "" and server.trace_id == trace_id
    call = service.stub.Generate.with_call(
        pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=2)),
        metadata=[("traceparent", "not-a-traceparent")],
        timeout=30,
    )
    assert call[0].finish_reason and _returned(dict(call[1].trailing_metadata())["traceparent"])


def test_failed_requests_get_an_error_status_with_the_exception(service, receiver):
    traceparent, trace_id, _ = _traceparent()
    r = httpx.post(
        f"{service.url}/v1/completions",
        timeout=30,
        headers={"traceparent": traceparent, "x-request-id": "bad-request-1"},
        json={"prompt": "hi", "max_tokens": 1000},
    )  # over max_model_len
    assert r.status_code == 400
    _, span_id = _returned(r.headers["traceparent"])
    span = receiver.wait_for_spans(lambda s: s.span_id == span_id)[0]
    assert span.status_code == ERROR and span.attributes["error.type"] == "BadRequest"
    exception = next(e for e in span.events if e[0] == "exception")
    assert exception[2]["exception.type"].endswith("BadRequest")
    summary = service.summary("bad-request-1")
    assert summary["status"] == "client_error" and summary["trace_id"] == trace_id

    traceparent, trace_id, _ = _traceparent()
    with pytest.raises(Exception) as info:
        service.stub.Generate(
            pb.GenerateRequest(
                prompt="hi", request_id="bad-grpc-1", params=pb.SamplingParams(max_tokens=1000)
            ),
            metadata=[("traceparent", traceparent)],
            timeout=30,
        )
    assert info.value.code().name == "INVALID_ARGUMENT"
    span = receiver.wait_for_spans(lambda s: s.trace_id == trace_id and s.kind == SERVER)[0]
    assert span.status_code == ERROR and any(e[0] == "exception" for e in span.events)
    assert span.attributes["rpc.grpc.status_code"] == 3
    assert service.summary("bad-grpc-1")["status"] == "client_error"


def _chat(url: str, request_id: str, traceparent: str, out: dict, **body) -> None:
    payload = {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "ignore_eos": True,
        "temperature": 0,
        **body,
    }
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=payload,
        timeout=120,
        headers={"traceparent": traceparent, "x-request-id": request_id},
    )
    out[request_id] = r


def test_every_log_line_of_a_request_carries_its_trace_ids_across_the_engine_thread(
    service, receiver
):
    """Two long requests at once overflow the 128-token KV cache (one is preempted: an
    engine-thread line); a third is dropped mid-stream (the engine logs the abort)."""
    expected: dict[str, str] = {}
    results: dict[str, httpx.Response] = {}
    threads = []
    for i in range(3):
        traceparent, trace_id, _ = _traceparent()
        rid = f"preempt-{i}"
        expected[rid] = trace_id
        threads.append(
            threading.Thread(
                target=_chat,
                args=(service.url, rid, traceparent, results),
                kwargs={"max_tokens": 100},
            )
        )
    for t in threads:
        t.start()
    traceparent, trace_id, _ = _traceparent()
    expected["aborted-1"] = trace_id
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            f"{service.url}/v1/completions",
            headers={"traceparent": traceparent, "x-request-id": "aborted-1"},
            json={
                "prompt": "once upon a time",
                "max_tokens": 100,
                "ignore_eos": True,
                "stream": True,
            },
        ) as stream,
    ):
        _, first = next(iter_sse(stream.iter_lines()))
        assert first["id"]
    for t in threads:
        t.join(120)
    assert all(results[f"preempt-{i}"].status_code == 200 for i in range(3))
    span_ids = {rid: _returned(r.headers["traceparent"])[1] for rid, r in results.items()}

    for rid in expected:
        service.summary(rid, timeout=30)  # the summary line is the request's last
    service.wait_for(
        lambda r: r.get("event") == "request aborted" and r.get("request_id") == "aborted-1"
    )
    by_request: dict[str, list[dict]] = {rid: [] for rid in expected}
    for record in list(service.records):
        rid = record.get("request_id")
        if rid in by_request:
            by_request[rid].append(record)
        elif record.get("trace_id") in expected.values():
            raise AssertionError(f"a line of a traced request without its request_id: {record}")
    for rid, records in by_request.items():
        assert records, rid
        assert {r.get("trace_id") for r in records} == {expected[rid]}, records
        assert all(len(r.get("span_id", "")) == 16 for r in records), records
        if rid in span_ids:
            assert {r["span_id"] for r in records} == {span_ids[rid]}
        assert sum(r["event"] == "request finished" for r in records) == 1

    engine_lines = [
        r
        for records in by_request.values()
        for r in records
        if r.get("logger", "").startswith("inference.")
    ]
    events = {r["event"] for r in engine_lines}
    assert {"sequence preempted", "request aborted"} <= events, events
    aborted = service.summary("aborted-1")
    assert aborted["finish_reason"] == "abort" and aborted["status"] == "client_error"
    preempted = {r["request_id"] for r in engine_lines if r["event"] == "sequence preempted"}
    preemptions = [
        receiver.wait_for_spans(lambda s, sid=span_ids[rid]: s.span_id == sid)[0].attributes[
            "moeserve.request.num_preemptions"
        ]
        for rid in preempted
    ]
    assert all(n >= 1 for n in preemptions)


def test_spans_and_every_log_line_name_the_replica(service, receiver):
    """service.instance.id, by default <hostname>:<REST port>: on the resource of the
    request's spans and of the engine's step spans, and on every line the server and its engine
    core process logged."""
    replica = f"{socket.gethostname()}:{service.rest_port}"
    traceparent, trace_id, _ = _traceparent()
    results: dict[str, httpx.Response] = {}
    _chat(service.url, "replica-1", traceparent, results, max_tokens=3)
    span_id = _returned(results["replica-1"].headers["traceparent"])[1]
    server = receiver.wait_for_spans(lambda s: s.span_id == span_id)[0]
    steps = receiver.wait_for_spans(
        lambda s: s.name == "engine_step" and (trace_id, span_id) in s.links
    )
    for span in (server, *steps):
        assert span.resource["service.instance.id"] == replica, span.resource
    service.summary("replica-1")
    records = list(service.records)
    assert {r.get("service.instance.id") for r in records} == {replica}
    loggers = {r.get("logger", "") for r in records}
    assert any(name.startswith("inference.") for name in loggers), loggers  # the core's too


def test_metrics_endpoint_negotiates_openmetrics_with_exemplars(service):
    httpx.post(f"{service.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    plain = httpx.get(f"{service.url}/metrics", timeout=10)
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/plain")
    assert "# {trace_id=" not in plain.text and "traceparent" not in plain.headers
    om = httpx.get(
        f"{service.url}/metrics",
        timeout=10,
        headers={"accept": "application/openmetrics-text; version=1.0.0"},
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    exemplar_lines = [line for line in om.text.splitlines() if "# {trace_id=" in line]
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert any(line.startswith(f"moeserve_{name}_seconds_bucket") for line in exemplar_lines)
    for name in SPEC_METRICS:
        assert f"\n{name}" in plain.text or plain.text.startswith(name), name
    # Bounded labels: one series per (layer, expert) of the model, request ids nowhere.
    expert_series = [
        line
        for line in plain.text.splitlines()
        if line.startswith("moeserve_moe_expert_tokens_total{")
    ]
    assert expert_series and len(expert_series) == len(set(expert_series))
    assert "rest-trace-1" not in plain.text and "cmpl-" not in plain.text
