"""End to end: every query of the moeserve / Replicas dashboard returns data from a real
Prometheus that scraped two real replicas and the real vllm-router (its --prometheus-port)
under load.

Two replicas (bench/replicas.py) behind vllm-router with cache_aware; two groups of
completions, each sharing a long prompt prefix, so that each group settles on a replica and
that replica's prefix cache hits. Debian's `prometheus` scrapes the replicas (job moeserve)
and the router (job vllm-router) every second. Then, with the dashboard's variables
substituted ($model, $instance, $router = all), each query must succeed with finite data that
shows the load (state gauges may be back to 0), the per-replica queries must show each replica
(by its instance), the router's per-worker queries each worker, the latency panels must
carry exemplars, and every template variable must find values.

Skips, saying so, without the `prometheus` binary (apt-get install prometheus) or vllm-router.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from stack_support import DASHBOARD_DIR, Prometheus, load_yaml, prometheus_targets, substitute

from bench.harness import wait_until
from bench.replicas import ROUTER, replicas

pytestmark = pytest.mark.slow

DASHBOARD = DASHBOARD_DIR / "moeserve-replicas.json"
MODEL = "tiny-demo"
# instantaneous state, legitimately back to 0 once the load is over
STATE = re.compile(
    r"moeserve_num_requests_(waiting|running)|moeserve_kv_cache_usage_ratio"
    r"|vllm_router_running_requests"
)
NOT_YET = (httpx.HTTPError, KeyError, ValueError, IndexError)
# two conversations' worth of shared context: each group's prompts share it
PREFIXES = [
    "You are a careful assistant for group A. " * 12,
    "Answer tersely, this is group B speaking. " * 12,
]


def finite(result: dict) -> list[float]:
    return [float(s["value"][1]) for s in result if math.isfinite(float(s["value"][1]))]


def drive_load(url: str) -> None:
    def completion(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"{PREFIXES[i % 2]} Question {i}:",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": i % 3 == 0,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text[:300]

    for i in range(2):  # one of each group first: each settles on a replica
        completion(i)
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(completion, i) for i in range(2, 40)]:
            future.result()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).status_code == 200


def wait_for_scrape_after(prometheus: Prometheus, moment: float) -> None:
    def scraped() -> bool:
        last = prometheus.api("query", query="timestamp(up)")["result"]
        return len(last) == 3 and min(float(s["value"][1]) for s in last) > moment

    wait_until(scraped, 30, "a scrape of every target after the load", 0.2, NOT_YET)


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing")
def test_every_replicas_panel_query_returns_data(tiny_model_dir, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (apt-get install prometheus); e2e check not run")
    serve_args = [
        "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
        "--kv-cache-tokens", "4096",
    ]  # fmt: skip
    # cache_aware that also balances as soon as one replica has 2 more requests in flight:
    # each replica gets a share of this short load (the defaults keep it all on one)
    balance = ["--balance-abs-threshold", 1, "--balance-rel-threshold", 1.0]
    with replicas(
        str(tiny_model_dir), 2, "cache_aware", serve_args=serve_args, router_args=balance
    ) as cluster:
        hosts = [r.server.url.removeprefix("http://") for r in cluster.replicas]
        router_host = cluster.router_metrics.removeprefix("http://").removesuffix("/metrics")
        jobs = {"moeserve": hosts, "vllm-router": [router_host]}
        prometheus = Prometheus(binary, tmp_path / "prometheus", jobs)
        try:
            prometheus.wait_ready()
            wait_until(
                lambda: len(prometheus.api("query", query="up == 1")["result"]) == 3,
                30,
                "the first successful scrape of both replicas and the router",
                0.2,
                NOT_YET,
            )
            # Two rounds of load with a scrape between: the router creates its series at
            # their first request, and rate() needs two samples that differ. One short round
            # can fall between two scrapes, leaving a single sample of each (a CI failure).
            for _ in range(2):
                drive_load(cluster.url)
                wait_for_scrape_after(prometheus, time.time())
            check_dashboard(prometheus, hosts, [r.server.url for r in cluster.replicas])
        finally:
            prometheus.stop()


def check_dashboard(prometheus: Prometheus, hosts: list[str], worker_urls: list[str]) -> None:
    dashboard = load_yaml(DASHBOARD)
    variables = {"model": MODEL, "instance": ".*", "router": ".*"}
    failures: list[str] = []
    for panel, target in prometheus_targets(dashboard):
        where = f"{panel['title']} / {target['refId']}"
        expr = substitute(target["expr"], variables)
        answer = prometheus.query(expr)
        if answer.get("status") != "success":
            failures.append(f"{where}: {answer.get('error')}\n    {expr}")
            continue
        result = answer["data"]["result"]
        values = finite(result)
        if not values:
            failures.append(f"{where}: no finite data\n    {expr}\n    {result[:3]}")
            continue
        if not any(values) and not STATE.search(expr):
            failures.append(f"{where}: only zeros, the load does not show\n    {expr}")
        legend = target.get("legendFormat", "")
        if "{{instance}}" in legend:  # a line per replica, each showing the load
            shown = {s["metric"].get("instance") for s in result}
            if shown != set(hosts):
                failures.append(f"{where}: replicas {sorted(shown)}, not {sorted(hosts)}")
            elif not STATE.search(expr) and not all(finite(result)):
                failures.append(f"{where}: a replica without load\n    {expr}\n    {result}")
        if "{{worker}}" in legend:  # the router's view of each replica
            shown = {s["metric"].get("worker") for s in result}
            if not shown <= set(worker_urls) or not shown:
                failures.append(f"{where}: workers {sorted(shown)}, not of {worker_urls}")
        if target.get("exemplar"):
            exemplars = prometheus.api(
                "query_exemplars", query=expr, start=time.time() - 600, end=time.time() + 1
            )
            ids = {e["labels"].get("trace_id") for s in exemplars for e in s["exemplars"]}
            if not ids:
                failures.append(f"{where}: exemplars requested, none stored")
    workers = prometheus.query(substitute("sum by (worker) (vllm_router_worker_health)", {}))
    assert {s["metric"]["worker"] for s in workers["data"]["result"]} == set(worker_urls)
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
        selector, label = substitute(m.group(1), variables), m.group(2)
        values = prometheus.api(f"label/{label}/values", **{"match[]": selector})
        if not values:
            failures.append(f"variable ${var['name']} finds no values ({selector})")
    assert not failures, f"{len(failures)} problem(s):\n" + "\n".join(failures)
