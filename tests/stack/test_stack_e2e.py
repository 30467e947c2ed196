"""End to end: every Grafana panel query returns data from a real Prometheus that scraped
the real service under load (the Replicas dashboard's: test_stack_replicas_dashboard.py).

Starts `moeserve serve` (tiny demo model, free ports) as a subprocess, drives a short load
(REST completions and chat, streamed and not, a few invalid requests, a few gRPC calls),
starts Debian's `prometheus` (exemplar storage on) scraping it every second, waits for
scrapes after the load, then runs every Prometheus query of grafana/dashboards with the
dashboard variables substituted ($model = the served model, $instance/$layer = all,
$__rate_interval = 1m, $__range = 5m) and checks:

- each query succeeds and returns at least one series with a finite value; panels about
  events this load does not cause (preemptions, 429 rejections, server errors) only have to
  be valid queries over a metric that exists;
- the latency panels that show exemplars get exemplars carrying a trace_id, and those
  trace ids are in the service's JSON log lines (the panel -> exemplar -> trace -> logs walk);
- every template variable query finds values (the served model among them);
- every moeserve_* metric family the service exports at /metrics appears in a panel.

Skips, saying so, without the `prometheus` binary (apt-get install prometheus).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from stack_support import (
    COMPOSE_YML,
    K8S_DIR,
    Prometheus,
    dashboards,
    load_yaml,
    load_yaml_all,
    metric_families_from_text,
    prometheus_targets,
    substitute,
    uses_family,
)

from bench.harness import (
    ServerProcess,
    free_port,
    read_sse,
    wait_until,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-demo"
SCRAPE_INTERVAL_S = 1
# Panels whose queries are about events this load does not cause: valid + metric exists.
# (no span exporter runs in this test: OTEL_TRACES_EXPORTER=none, so no span is exported
# or dropped)
EVENT_DEPENDENT = re.compile(
    r'moeserve_preemptions_total|status="rejected"|status="server_error"|status!="ok"'
    r"|moeserve_trace_spans_(exported|dropped)_total|moeserve_rate_limited_total"
)
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# the load runs under a named API key with limits, so the per-key series exist
LOAD_KEY = "sk-stack-e2e-load"
AUTH = {"authorization": f"Bearer {LOAD_KEY}"}
# Instantaneous state that is legitimately back to 0 once the load is over; every other
# query must show the load (a non-zero value).
STATE_GAUGES = {
    "moeserve_num_requests_running",
    "moeserve_num_requests_waiting",
    "moeserve_kv_cache_usage_ratio",
    "moeserve_moe_hot_expert",  # an expert id: 0 is expert 0
}


# proven against two replicas and the router in test_stack_replicas_dashboard.py
REPLICAS_DASHBOARD = "moeserve-replicas.json"


def single_replica_dashboards() -> dict[str, dict]:
    return {name: d for name, d in dashboards().items() if name != REPLICAS_DASHBOARD}


def probe_paths() -> set[str]:
    """HTTP paths the Kubernetes probes, the PodMonitor and the compose health check use."""
    paths: set[str] = set()
    for manifest in K8S_DIR.glob("*.yaml"):
        for doc in load_yaml_all(manifest):
            if doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    paths |= {c[p]["httpGet"]["path"] for p in c if p.endswith("Probe")}
            if doc.get("kind") == "PodMonitor":
                paths |= {e["path"] for e in doc["spec"]["podMetricsEndpoints"]}
    check = " ".join(load_yaml(COMPOSE_YML)["services"]["moeserve"]["healthcheck"]["test"])
    paths |= set(re.findall(r"http://127\.0\.0\.1:\d+(/\w+)", check))
    assert {"/ready", "/health", "/metrics"} <= paths, paths
    return paths


def only_state(expr: str) -> bool:
    """A query over instantaneous state only (possibly relative to the configured bound)."""
    metrics = set(re.findall(r"moeserve_\w+", expr))
    return bool(metrics & STATE_GAUGES) and metrics <= STATE_GAUGES | {"moeserve_max_waiting"}


# what a predicate reading Prometheus' answers raises while the data is not there yet
NOT_YET = (httpx.HTTPError, KeyError, ValueError, IndexError)


def start_service(model_dir: Path, workdir: Path, rest_port: int) -> ServerProcess:
    """`moeserve serve` on `rest_port` (and a free gRPC port), started, not waited for."""
    limits = {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000}
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "load", "key": LOAD_KEY, **limits}]}))
    return ServerProcess(
        model_dir,
        "--served-model-name", MODEL, "--device", "cpu", "--max-num-seqs", "8",
        "--drain-timeout", "5", "--api-keys-file", keys,
        "--cost-per-hour", "2.5",  # the cost panel's gauges
        # the speculative-decoding panels: n-gram drafts (drive_load's `repeating` accepts some)
        "--speculative-config", json.dumps(SPECULATION),
        port=rest_port,
        grpc=True,
        env={
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_SERVICE_NAME": "moeserve",
            "OTEL_EXPORTER_OTLP_ENDPOINT": None,
            "TOKENIZERS_PARALLELISM": "false",
            "MOESERVE_CACHE_DIR": str(workdir / "cache"),
        },
        log_path=workdir / "moeserve.log",
        stop_timeout=20,
    ).start()  # fmt: skip


def drive_load(rest: str, grpc_port: int | None) -> dict:
    """A few dozen REST requests (streamed and not, completions and chat, some invalid)
    and a few gRPC calls, 8 at a time. Returns what was sent and seen."""
    seen = {"ok": 0, "client_error": 0, "trace_ids": set()}
    lock = threading.Lock()

    def note(resp: httpx.Response, expect: int) -> None:
        assert resp.status_code == expect, (resp.status_code, resp.text[:300])
        tp = resp.headers.get("traceparent", "")
        with lock:
            seen["ok" if expect == 200 else "client_error"] += 1
            if re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", tp):
                seen["trace_ids"].add(tp.split("-")[1])

    def completion(i: int) -> None:
        with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
            note(
                c.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": f"Count to {i}:",
                        "max_tokens": 6 + i % 5,
                        "temperature": 0,
                    },
                ),
                200,
            )

    def chat(i: int) -> None:
        with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
            note(
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"Say something {i}"}],
                        "max_tokens": 8,
                        "temperature": 0.7,
                        "seed": i,
                    },
                ),
                200,
            )

    def stream(i: int) -> None:
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        body = {
            "model": MODEL,
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(
            {"messages": [{"role": "user", "content": f"Stream {i}"}]}
            if i % 2
            else {"prompt": f"Stream {i}"}
        )
        with (
            httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c,
            c.stream("POST", path, json=body) as r,
        ):
            note(r, 200)
            read_sse(r)  # data: {json} events to data: [DONE]

    def constrained(i: int) -> None:  # a distinct regex each: compiled, not cached
        with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
            body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 4}
            body["structured_outputs"] = {"regex": f"[ab]{{1,{i + 2}}}"}
            note(c.post("/v1/completions", json=body), 200)

    def repeating(i: int) -> None:  # greedy text repeating its prompt: n-gram drafts accepted
        with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
            body = {"model": MODEL, "prompt": f"{i} one two three " * 6, "max_tokens": 24}
            note(
                c.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True}), 200
            )

    def invalid(i: int) -> None:
        with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
            note(
                c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}),
                400,
            )

    jobs = (
        [(completion, i) for i in range(16)]
        + [(chat, i) for i in range(8)]
        + [(stream, i) for i in range(10)]
        + [(constrained, i) for i in range(4)]
        + [(repeating, i) for i in range(4)]
        + [(invalid, i) for i in range(2)]
    )
    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(fn, i) for fn, i in jobs]:
            future.result()
    # the prefix cache: one after the other, prompts sharing several blocks' worth of text
    preamble = "Every answer starts from the same long shared preamble. " * 8
    with httpx.Client(base_url=rest, timeout=60, headers=AUTH) as c:
        for i in range(3):
            body = {"model": MODEL, "prompt": f"{preamble} Question {i}:", "max_tokens": 2}
            note(c.post("/v1/completions", json=body), 200)

    if grpc_port:
        import grpc

        from service.proto.moeserve.v1 import inference_pb2, inference_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            params = inference_pb2.SamplingParams(max_tokens=8, temperature=0)
            for i in range(3):
                reply = stub.Generate(
                    inference_pb2.GenerateRequest(prompt=f"gRPC {i}", params=params),
                    timeout=60,
                    metadata=tuple(AUTH.items()),
                )
                assert reply.finish_reason
                chunks = list(
                    stub.GenerateStream(
                        inference_pb2.GenerateRequest(prompt=f"gRPC stream {i}", params=params),
                        timeout=60,
                        metadata=tuple(AUTH.items()),
                    )
                )
                assert chunks and chunks[-1].finish_reason
                seen["ok"] += 2
    return seen


def promql_regex_literal(text: str) -> str:
    """`text` as a regex matching it literally, written inside a PromQL double-quoted
    string (where a backslash itself needs escaping), as Grafana's regex format does."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\\\1", text)


def finite_values(result: dict) -> list[float]:
    data = result["data"]
    if data["resultType"] == "scalar":
        values = [data["result"][1]]
    else:
        values = [s["value"][1] for s in data["result"]]
    return [float(v) for v in values if math.isfinite(float(v))]


def test_every_panel_query_returns_data(tiny_model_dir, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (apt-get install prometheus); e2e check not run")
    # The REST port is chosen here so that Prometheus can start (and its first scrape,
    # a few seconds after its start, can come) while the model loads.
    rest_port = free_port()
    service = start_service(tiny_model_dir, tmp_path, rest_port)
    prometheus = Prometheus(
        binary, tmp_path / "prometheus", {"moeserve": [f"127.0.0.1:{rest_port}"]}, SCRAPE_INTERVAL_S
    )
    try:
        started = service.wait_ready(180)
        assert started["rest_port"] == rest_port
        rest = f"http://127.0.0.1:{rest_port}"
        prometheus.wait_ready()
        with httpx.Client(base_url=rest, timeout=10) as c:
            metrics = c.get("/metrics", headers={"Accept": "application/openmetrics-text"})
            assert metrics.status_code == 200, f"GET /metrics: {metrics.status_code}"
            # The probe and scrape paths of the deployment manifests answer 200 when ready.
            for path in probe_paths():
                assert c.get(path).status_code == 200, path

        # Scrape before the load too, so that rates see it (the first scrape of a new
        # target comes a few seconds after Prometheus starts).
        wait_until(
            lambda: prometheus.api("query", query='up{job="moeserve"} == 1')["result"],
            30,
            "the first successful scrape of moeserve",
            0.2,
            NOT_YET,
        )
        t0 = time.time()
        seen = drive_load(rest, started.get("grpc_port"))
        load_end = time.time()

        # At least 3 scrapes, the last one after the load finished.
        def scraped():
            data = prometheus.api("query", query='count_over_time(up{job="moeserve"}[5m])')
            last = prometheus.api("query", query='timestamp(up{job="moeserve"})')
            return (
                data["result"]
                and float(data["result"][0]["value"][1]) >= 3
                and float(last["result"][0]["value"][1]) > load_end + 0.1
            )

        wait_until(scraped, 30, "3 scrapes of moeserve, one after the load", 0.2, NOT_YET)
        up = prometheus.api("query", query='up{job="moeserve"}')["result"]
        assert up and up[0]["value"][1] == "1", f"scrape failing: {prometheus.api('targets')}"

        variables = {"model": promql_regex_literal(MODEL), "instance": ".*", "layer": ".*"}
        failures: list[str] = []
        exemplar_trace_ids: set[str] = set()
        checked = 0
        for name, dashboard in single_replica_dashboards().items():
            for panel, target in prometheus_targets(dashboard):
                where = f"{name} / {panel['title']} / {target['refId']}"
                expr = substitute(target["expr"], variables)
                result = prometheus.query(expr)
                checked += 1
                if result.get("status") != "success":
                    failures.append(f"{where}: {result.get('error')}\n    {expr}")
                    continue
                if EVENT_DEPENDENT.search(expr):
                    for metric in set(re.findall(r"moeserve_\w+", expr)):
                        if not prometheus.api("series", **{"match[]": metric}):
                            failures.append(f"{where}: metric {metric} does not exist")
                    continue
                if not result["data"]["result"]:
                    failures.append(f"{where}: no data\n    {expr}")
                elif not finite_values(result):
                    failures.append(
                        f"{where}: only NaN/Inf\n    {expr}\n    {result['data']['result'][:3]}"
                    )
                elif not any(finite_values(result)) and not only_state(expr):
                    failures.append(f"{where}: only zeros, the load does not show\n    {expr}")
                if target.get("exemplar"):
                    exemplars = prometheus.api(
                        "query_exemplars", query=expr, start=t0 - 60, end=time.time() + 1
                    )
                    ids = {
                        e["labels"].get("trace_id", "") for s in exemplars for e in s["exemplars"]
                    }
                    if not ids:
                        failures.append(f"{where}: exemplars requested, none stored\n    {expr}")
                    bad = {i for i in ids if not re.fullmatch(r"[0-9a-f]{32}", i)}
                    if bad:
                        failures.append(
                            f"{where}: exemplar trace ids not 32-hex: {sorted(bad)[:3]}"
                        )
                    exemplar_trace_ids |= ids - bad
        assert checked >= 40, checked

        # Template variables.
        for name, dashboard in single_replica_dashboards().items():
            for var in dashboard["templating"]["list"]:
                if var["type"] != "query":
                    continue
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
                selector, label = substitute(m.group(1), variables), m.group(2)
                values = prometheus.api(f"label/{label}/values", **{"match[]": selector})
                if not values:
                    failures.append(f"{name}: variable ${var['name']} finds no values ({selector})")
                if var["name"] == "model" and MODEL not in values:
                    failures.append(f"{name}: variable $model does not offer {MODEL}: {values}")

        # panel -> exemplar -> trace -> logs: the exemplars' trace ids are in the log lines.
        logged = {r.get("trace_id") for r in service.records}
        missing_in_logs = exemplar_trace_ids - logged
        if exemplar_trace_ids and missing_in_logs:
            failures.append(
                f"exemplar trace ids absent from the service's log lines: {sorted(missing_in_logs)[:5]}"
            )
        if seen["trace_ids"] and exemplar_trace_ids and not exemplar_trace_ids & seen["trace_ids"]:
            failures.append("no exemplar trace id matches a traceparent returned to a client")

        # Every metric family the service exports appears in a panel.
        families = {
            f: k
            for f, k in metric_families_from_text(metrics.text).items()
            if f.startswith("moeserve_")
        }
        exprs = [t["expr"] for d in dashboards().values() for _, t in prometheus_targets(d)]
        uncovered = sorted(
            f for f, k in families.items() if not any(uses_family(e, f, k) for e in exprs)
        )
        if uncovered:
            failures.append(f"exported metrics in no panel: {uncovered}")
        assert len(families) >= 15, sorted(families)

        assert not failures, f"{len(failures)} problem(s):\n" + "\n".join(failures)
    except BaseException:
        print(service.tail())
        raise
    finally:
        prometheus.stop()
        service.stop()
