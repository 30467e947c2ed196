"""The inspector's JSON API against real servers: what it records for completed, invalid,
aborted and rejected requests, the steps requests share, the engine view, the bounds, the
API key, the prompt-text policy, --no-inspector and the OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from bench.harness import InProcessServer, iter_sse, wait_until
from service.api_keys import KeyRing
from service.cli import build_parser
from service.settings import from_namespace
from tests.inspector.conftest import COMPLETIONS
from tests.inspector.helpers import engine_paused

SECRET = "the secret word is platypus"
TEMPLATE = "http://grafana.example/explore?traceId={trace_id}&x=1"
RING = 3


@pytest.fixture(scope="module")
def small(start_inspector) -> Iterator[InProcessServer]:
    """A server with a 3-request ring, one sequence slot and one waiting place (429s on
    demand), prompt text on and a trace link."""
    with start_inspector(
        inspector_requests=RING,
        max_num_seqs=1,
        max_waiting=1,
        log_prompts=True,
        trace_url_template=TEMPLATE,
    ) as srv:
        yield srv


def _detail(http: httpx.Client, key: str) -> dict:
    r = http.get(f"/inspect/api/requests/{key}")
    assert r.status_code == 200, r.text
    return r.json()


def _wait_detail(http: httpx.Client, key: str, predicate, what: str) -> dict:
    """The request's detail once `predicate(detail)` holds (bounded)."""
    return wait_until(
        lambda: (d := http.get(f"/inspect/api/requests/{key}").json()) and predicate(d) and d,
        timeout=30,
        what=what,
    )


def _events(detail: dict) -> list[dict]:
    return [json.loads(line) for line in detail["logs"]]


def _stream_one_event(http: httpx.Client, request_id: str, max_tokens: int):
    """Opens a streamed completion and reads its first event (the request is running);
    returns the open response (closing it aborts the request)."""
    body = {"prompt": "count slowly", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = http.build_request(
        "POST", COMPLETIONS, json=body, headers={"x-request-id": request_id}
    )
    response = http.send(request, stream=True)
    assert response.status_code == 200
    next(iter_sse(response.iter_lines()))
    return response


def test_completed_request_has_its_phases_steps_and_log_line(http):
    r = http.post(
        COMPLETIONS,
        json={"prompt": "hello there", "max_tokens": 6, "ignore_eos": True},
        headers={"x-request-id": "api-ok-1"},
    )
    assert r.status_code == 200
    d = _detail(http, "api-ok-1")
    req = d["request"]
    assert (req["api"], req["outcome"], req["status"], req["code"]) == ("rest", "ok", "ok", "200")
    assert (req["finish_reason"], req["completion_tokens"]) == ("length", 6)
    assert req["response_id"] == r.json()["id"] and req["operation"] == "text_completion"
    assert req["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    for name in ("queue_ms", "ttft_ms", "tpot_ms", "e2e_ms"):
        assert req[name] is not None and req[name] >= 0, name
    assert req["trace_id"] == r.headers["traceparent"].split("-")[1]
    assert [p["name"] for p in d["phases"]] == ["queue", "prefill", "decode"]
    assert d["first_token_ms"] == pytest.approx(req["ttft_ms"], abs=1e-3)
    assert d["phases"][-1]["end_ms"] == pytest.approx(req["e2e_ms"], abs=1e-3)
    # one step samples each token: the prefill step the first, then 5 decode steps
    phases = [s["phase"] for s in d["steps"]]
    assert phases == ["prefill"] + ["decode"] * 5, phases
    assert d["steps_omitted"] == 0
    assert all(s["batch_size"] >= 1 and s["duration_ms"] > 0 for s in d["steps"])
    indexes = [s["index"] for s in d["steps"]]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)
    (summary,) = [e for e in _events(d) if e["event"] == "request finished"]
    assert summary["request_id"] == "api-ok-1" and summary["trace_id"] == req["trace_id"]
    assert summary["service.instance.id"] == http.get("/inspect/api/engine").json()["instance"]
    assert d["trace_url"] is None and d["prompt"] is None and d["outputs"] is None
    # the inspector's id, the response id and the trace id find it too
    for key in (req["id"], req["response_id"], req["trace_id"]):
        assert _detail(http, key)["request"]["request_id"] == "api-ok-1"


def test_invalid_request_is_listed_as_an_error_with_its_message(http):
    r = http.post(
        COMPLETIONS, json={"prompt": "hi", "max_tokens": 0}, headers={"x-request-id": "api-400"}
    )
    assert r.status_code == 400
    rows = http.get("/inspect/api/requests", params={"filter": "errors"}).json()["requests"]
    (row,) = [row for row in rows if row["request_id"] == "api-400"]
    assert (row["outcome"], row["status"], row["code"]) == ("error", "client_error", "400")
    assert "max_tokens" in row["error"] and row["finish_reason"] is None
    d = _detail(http, "api-400")
    assert d["phases"] == [] and d["steps"] == []  # never reached the engine
    assert [e["status"] for e in _events(d) if e["event"] == "request finished"] == ["client_error"]
    all_rows = http.get("/inspect/api/requests", params={"filter": "aborts"}).json()["requests"]
    assert "api-400" not in [row["request_id"] for row in all_rows]


def test_requests_in_the_same_steps_name_each_other(server):
    async def both() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            body = {"prompt": "together", "max_tokens": 24, "ignore_eos": True}
            rs = await asyncio.gather(
                *(
                    c.post(COMPLETIONS, json=body, headers={"x-request-id": f"pair-{i}"})
                    for i in range(2)
                )
            )
            return [r.json()["id"] for r in rs]

    ids = asyncio.run(asyncio.wait_for(both(), 60))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        d = _detail(http, "pair-0")
        other = _detail(http, "pair-1")["request"]
    shared = [s for s in d["steps"] if s["others_count"]]
    assert shared, "the two requests never shared a step"
    for step in shared:
        assert step["batch_size"] == step["others_count"] + 1
        assert step["others"] == [{"response_id": ids[1], "id": other["id"]}]


def test_client_disconnect_is_listed_as_aborted_with_the_engines_line(http):
    response = _stream_one_event(http, "api-abort", max_tokens=400)
    response.close()  # the client goes away mid-stream
    d = _wait_detail(
        http,
        "api-abort",
        lambda d: any(e["event"] == "request aborted" for e in _events(d)),
        "the engine's 'request aborted' line",
    )
    req = d["request"]
    assert (req["outcome"], req["code"], req["finish_reason"]) == ("aborted", "499", "abort")
    assert req["status"] == "client_error" and req["error"] is None
    (line,) = [e for e in _events(d) if e["event"] == "request aborted"]
    assert line["logger"] == "inference.engine" and line["trace_id"] == req["trace_id"]
    assert [p["name"] for p in d["phases"]][:2] == ["queue", "prefill"]
    rows = http.get("/inspect/api/requests", params={"filter": "aborts"}).json()["requests"]
    assert "api-abort" in [row["request_id"] for row in rows]


def _rejected_rows(http: httpx.Client) -> list[tuple]:
    rows = http.get("/inspect/api/requests", params={"filter": "rejected"}).json()["requests"]
    return [(row["request_id"], row["code"], row["status"], row["error"]) for row in rows]


def test_a_full_queue_is_listed_as_rejected(small):
    srv = small
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        running = _stream_one_event(http, "q-running", max_tokens=480)  # the one sequence slot

        def wait_in_line() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as other:
                body = {"prompt": "next", "max_tokens": 2}
                other.post(COMPLETIONS, json=body, headers={"x-request-id": "q-waiting"})

        waiting = threading.Thread(target=wait_in_line)
        with engine_paused(srv.engine._process.pid):
            waiting.start()
            wait_until(lambda: srv.engine.num_waiting == 1, 30, "a waiting request")
            body = {"prompt": "one more", "max_tokens": 2}
            r = http.post(COMPLETIONS, json=body, headers={"x-request-id": "q-full"})
            assert r.status_code == 429
            running.close()
        waiting.join(60)
        ((request_id, code, status, error),) = _rejected_rows(http)
        assert (request_id, code, status) == ("q-full", "429", "rejected")
        assert "max_waiting=1" in error
        done = _wait_detail(
            http, "q-waiting", lambda d: d["request"]["outcome"] == "ok", "q-waiting done"
        )
        assert done["phases"][0]["name"] == "queue" and done["phases"][0]["end_ms"] > 0


def test_engine_view_has_series_and_the_expert_heatmap(http, server):
    http.post(COMPLETIONS, json={"prompt": "warm", "max_tokens": 4})
    e = http.get("/inspect/api/engine").json()
    assert e["model"] == server.state.model_name
    assert e["instance"] == f"{socket.gethostname()}:{server.server.rest_port}"  # the replica
    assert e["running"] >= 0 and e["waiting"] >= 0 and 0 <= e["kv_usage"] <= 1
    assert e["steps"] >= 4
    s = e["series"]
    lengths = {len(s[k]) for k in ("step_ms", "tokens_per_s", "prefill_tokens_per_s", "batch_size")}
    assert lengths == {120}
    assert sum(s["tokens_per_s"]) >= 4 and any(v for v in s["step_ms"] if v)
    args = server.engine.args
    tokens = e["experts"]["tokens"]
    assert len(tokens) == args.num_layers and {len(row) for row in tokens} == {args.num_experts}
    # every token of a step goes to top_k experts in each MoE layer
    assert all(sum(row) == sum(tokens[0]) for row in tokens) and sum(tokens[0]) > 0
    experts = e["experts"]
    assert experts["num_experts"] == args.num_experts
    assert [layer["layer"] for layer in experts["layers"]] == list(range(args.num_layers))
    for layer, row in zip(experts["layers"], tokens, strict=True):
        assert layer["tokens"] == sum(row)
        assert layer["imbalance"] == pytest.approx(max(row) * len(row) / sum(row), abs=1e-3)
        top = layer["top"]
        assert [h["tokens"] for h in top] == sorted((t for t in row if t), reverse=True)
        assert all(row[h["expert"]] == h["tokens"] for h in top)


def test_unknown_id_is_a_404_envelope(http):
    r = http.get("/inspect/api/requests/no-such-request")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_request"
    assert http.get("/inspect/api/requests", params={"filter": "nope"}).status_code == 400
    assert http.get("/inspect/api/requests", params={"limit": 0}).status_code == 400


def test_limit_and_newest_first(http):
    for i in range(3):
        http.post(
            COMPLETIONS,
            json={"prompt": "hi", "max_tokens": 1},
            headers={"x-request-id": f"lim-{i}"},
        )
    rows = http.get("/inspect/api/requests", params={"limit": 2}).json()["requests"]
    assert [r["request_id"] for r in rows] == ["lim-2", "lim-1"]


def test_api_key_guards_the_api_not_the_page(server, http):
    open_keys = server.state.keys
    server.state.keys = KeyRing("sk-inspect")  # what --api-key sk-inspect starts with
    try:
        for path in ("/inspect/api/requests", "/inspect/api/engine", "/inspect/api/requests/1"):
            r = http.get(path)
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
            r = http.get(path, headers={"authorization": "Bearer sk-inspect"})
            assert r.status_code in (200, 404), path  # 404: request 1 may have left the ring
        page = http.get("/inspect")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert http.get("/inspect/static/inspector.js").status_code == 200
    finally:
        server.state.keys = open_keys


def test_the_page_loads_nothing_from_elsewhere(http):
    page = http.get("/inspect").text
    for asset in ("/inspect/static/inspector.js", "/inspect/static/inspector.css"):
        assert asset in page and http.get(asset).status_code == 200
    assert "http://" not in page and "https://" not in page


def test_ring_keeps_only_the_newest_requests(small):
    recorder = small.state.inspector
    before = recorder.recorded
    with httpx.Client(base_url=small.url, timeout=30) as http:
        for i in range(7):
            body = {"prompt": "hi", "max_tokens": 2}
            r = http.post(COMPLETIONS, json=body, headers={"x-request-id": f"ring-{i}"})
            assert r.status_code == 200
        body = http.get("/inspect/api/requests").json()
        assert [r["request_id"] for r in body["requests"]] == ["ring-6", "ring-5", "ring-4"]
        assert (body["capacity"], body["recorded"]) == (RING, before + 7)
        assert http.get("/inspect/api/requests/ring-0").status_code == 404
    assert len(recorder.records) == RING
    assert len(recorder.logs) <= 2 * RING  # log lines of at most twice as many traces
    assert not recorder._live  # nothing running is left behind


def test_no_prompt_or_output_text_without_log_prompts(http):
    r = http.post(
        COMPLETIONS, json={"prompt": SECRET, "max_tokens": 4}, headers={"x-request-id": "no-text"}
    )
    assert r.status_code == 200
    raw = http.get("/inspect/api/requests/no-text").text
    d = json.loads(raw)
    assert d["prompt"] is None and d["outputs"] is None
    assert "platypus" not in raw
    listing = http.get("/inspect/api/requests").text
    assert "platypus" not in listing


def test_text_and_trace_link_with_log_prompts(small):
    with httpx.Client(base_url=small.url, timeout=30) as http:
        body = {"prompt": SECRET, "max_tokens": 4}
        r = http.post(COMPLETIONS, json=body, headers={"x-request-id": "text"})
        d = _detail(http, "text")
    assert "platypus" in d["prompt"]
    assert d["outputs"] == [r.json()["choices"][0]["text"]]
    trace_id = d["request"]["trace_id"]
    assert d["trace_url"] == f"http://grafana.example/explore?traceId={trace_id}&x=1"
    (summary,) = [e for e in _events(d) if e["event"] == "request finished"]
    assert "platypus" in summary["prompt"]  # the same line the logger wrote


@pytest.mark.slow  # a server of its own
def test_no_inspector_means_no_routes(start_inspector):
    with (
        start_inspector(no_inspector=True) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as http,
    ):
        assert srv.state.inspector is None
        for path in (
            "/inspect",
            "/inspect/api/requests",
            "/inspect/api/requests/1",
            "/inspect/api/engine",
            "/inspect/static/inspector.js",
        ):
            assert http.get(path).status_code == 404, path
        assert http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        paths = http.get("/schema/openapi.json").json()["paths"]
        assert not [p for p in paths if p.startswith("/inspect")]


def test_openapi_lists_the_inspector_api(http):
    document = http.get("/schema/openapi.json").json()
    paths, components = document["paths"], document["components"]["schemas"]
    wanted = {
        "/inspect/api/requests": ("inspectorListRequests", "InspectorRequestList"),
        "/inspect/api/requests/{id}": ("inspectorGetRequest", "InspectorRequestDetail"),
        "/inspect/api/engine": ("inspectorEngine", "InspectorEngine"),
    }
    for path, (operation_id, body) in wanted.items():
        op = paths[path]["get"]
        assert op["operationId"] == operation_id
        assert "401" in op["responses"]
        schema = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{body}"}
        assert body in components
    assert "/inspect" not in paths  # the page is not part of the API
    filter_param = next(
        p for p in paths["/inspect/api/requests"]["get"]["parameters"] if p["name"] == "filter"
    )
    assert set(filter_param["schema"]["enum"]) == {"all", "errors", "aborts", "rejected", "slow"}
    refs = {m for m in json.dumps(document).split('"') if m.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(components)  # every $ref resolves


def test_flags_and_their_environment_variables(monkeypatch):
    ns = build_parser().parse_args(
        [
            "serve",
            "--no-inspector",
            "--inspector-requests",
            "5",
            "--trace-url-template",
            "http://t/{trace_id}",
        ]
    )
    s = from_namespace(ns)
    assert (s.no_inspector, s.inspector_requests, s.trace_url_template) == (
        True,
        5,
        "http://t/{trace_id}",
    )
    defaults = from_namespace(build_parser().parse_args(["serve"]))
    assert (defaults.no_inspector, defaults.inspector_requests, defaults.trace_url_template) == (
        False,
        1000,
        None,
    )
    monkeypatch.setenv("MOESERVE_NO_INSPECTOR", "1")
    monkeypatch.setenv("MOESERVE_INSPECTOR_REQUESTS", "42")
    monkeypatch.setenv("MOESERVE_TRACE_URL_TEMPLATE", "http://env/{trace_id}")
    s = from_namespace(build_parser().parse_args(["serve"]))
    assert (s.no_inspector, s.inspector_requests, s.trace_url_template) == (
        True,
        42,
        "http://env/{trace_id}",
    )
