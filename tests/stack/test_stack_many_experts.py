"""The MoE experts dashboard against a 256-expert model: a demo checkpoint of 58 MoE layers
routing 8 of 256 experts, served by `moeserve serve` and scraped by a real Prometheus.
Every query of the dashboard answers, and answers with what a panel can show: a line or
heatmap row per layer at most, ranges of experts rather than 256 rows per layer."""

from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest
from stack_support import dashboards, prometheus_targets, substitute
from test_stack_e2e import NOT_YET, Prometheus, finite_values

from bench.harness import ServerProcess, free_port, wait_until
from inference.checkpoints.demo_model import write_demo_model
from tests.inspector.test_inspector_many_experts import EXPERTS, LAYERS, MANY_EXPERTS

pytestmark = pytest.mark.slow

MODEL = "many-experts"
BUCKETS = EXPERTS // 8  # ranges of 8 experts: 58 x 32 series fit the 2048 limit
# A range query draws a line (or a heatmap row) per series: a layer's worth at most.
MAX_DRAWN_SERIES = LAYERS


def test_moe_dashboard_queries_stay_readable_at_256_experts(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (apt-get install prometheus); e2e check not run")
    model_dir = write_demo_model(tmp_path / "model", MANY_EXPERTS, seed=0)
    port = free_port()
    server = ServerProcess(
        model_dir, "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "512", "--kv-cache-tokens", "4096", port=port,
        env={"OTEL_TRACES_EXPORTER": "none"}, start_timeout=300,
    )  # fmt: skip
    prometheus = Prometheus(binary, tmp_path / "prometheus", {"moeserve": [f"127.0.0.1:{port}"]})
    try:
        server.start()
        server.wait_ready()
        prometheus.wait_ready()
        # A scrape before the load, so that rates see the counters grow: without it the
        # expert counters can have one sample only, and every rate() panel reads no data.
        wait_until(
            lambda: prometheus.api("query", query='up{job="moeserve"} == 1')["result"],
            30, "the first successful scrape of moeserve", 0.2, NOT_YET,
        )  # fmt: skip
        for i in range(3):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": f"route me {i}", "max_tokens": 4, "ignore_eos": True},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        load_end = time.time()

        def scraped_twice_after_the_load():
            # rate() needs two samples of each expert counter, and the counters appear with
            # the first routed token: two scrapes of them, the last one after the load
            count = prometheus.api(
                "query", query="min(count_over_time(moeserve_moe_expert_tokens_total[5m]))"
            )
            last = prometheus.api("query", query='timestamp(up{job="moeserve"})')
            return (
                count["result"]
                and float(count["result"][0]["value"][1]) >= 2
                and float(last["result"][0]["value"][1]) > load_end + 0.1
            )

        wait_until(
            scraped_twice_after_the_load, 30, "2 scrapes of the expert counters", 0.2, NOT_YET
        )
        series = prometheus.api("series", **{"match[]": "moeserve_moe_expert_tokens_total"})
        assert len(series) == LAYERS * BUCKETS
        assert {s["expert"] for s in series} == {f"{lo}-{lo + 7}" for lo in range(0, EXPERTS, 8)}

        (moe,) = [d for d in dashboards().values() if d["title"] == "moeserve / MoE experts"]
        variables = {"model": MODEL, "instance": ".*", "layer": ".*"}
        checked, failures = 0, []
        for panel, target in prometheus_targets(moe):
            where = f"{panel['title']} / {target['refId']}"
            result = prometheus.query(substitute(target["expr"], variables))
            checked += 1
            if result.get("status") != "success":
                failures.append(f"{where}: {result.get('error')}")
                continue
            rows = result["data"]["result"]
            if not rows or not finite_values(result):
                failures.append(f"{where}: no data")
            if target["range"] and len(rows) > MAX_DRAWN_SERIES:
                failures.append(f"{where}: {len(rows)} series drawn")
            if target["instant"] and len(rows) > LAYERS * BUCKETS:
                failures.append(f"{where}: {len(rows)} table rows")
        assert checked >= 15 and not failures, "\n".join(failures)

        # the drill-down heatmap of one layer: a row per range of experts, named by its
        # first expert so that the rows sort as numbers
        (drill,) = [p for p, _ in prometheus_targets(moe) if p.get("repeat") == "layer"]
        expr = substitute(drill["targets"][0]["expr"], {**variables, "layer": "5"})
        rows = prometheus.query(expr)["data"]["result"]
        assert sorted(int(r["metric"]["first"]) for r in rows) == list(range(0, EXPERTS, 8))
        assert all(re.fullmatch(r"\d+-\d+", r["metric"]["expert"]) for r in rows)
    finally:
        prometheus.stop()
        server.stop()
