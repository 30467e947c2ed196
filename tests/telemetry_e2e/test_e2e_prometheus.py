"""A real Prometheus (Debian's `prometheus`, exemplar storage on) scrapes the service under a
short REST + gRPC load: every SPEC section 8 metric is queryable, and the TTFT exemplars
carry trace ids the OTLP receiver saw."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2e_support import OtlpReceiver, Service

from bench.harness import ManagedProcess, free_port, prometheus_process, wait_for_http, wait_until
from service.proto.moeserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow

# Histograms are stored as _bucket/_count/_sum series: query their _count.
SPEC_SERIES = (
    "moeserve_time_to_first_token_seconds_count", "moeserve_time_per_output_token_seconds_count",
    "moeserve_e2e_request_latency_seconds_count", "moeserve_request_queue_time_seconds_count",
    "moeserve_prompt_tokens_total", "moeserve_generation_tokens_total", "moeserve_requests_total",
    "moeserve_num_requests_running", "moeserve_num_requests_waiting",
    "moeserve_kv_cache_usage_ratio", "moeserve_batch_size_count", "moeserve_engine_step_seconds_count",
    "moeserve_preemptions_total", "moeserve_moe_expert_tokens_total",
    "moeserve_moe_expert_imbalance",
)  # fmt: skip
NUM_REST, NUM_GRPC = 12, 4


def _start_prometheus(tmp_path: Path, target: str) -> tuple[ManagedProcess, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary not installed (apt-get install prometheus)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 400ms}\n"
        "scrape_configs:\n"
        "  - job_name: moeserve\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    proc = prometheus_process(binary, config, tmp_path, port)
    return proc.start(), f"http://127.0.0.1:{port}"


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def _load(service: Service) -> None:
    def rest(i: int) -> None:
        body = {"prompt": f"request {i}", "max_tokens": 8, "ignore_eos": True, "stream": i % 2 == 0}
        assert httpx.post(f"{service.url}/v1/completions", json=body, timeout=60).status_code == 200

    threads = [threading.Thread(target=rest, args=(i,)) for i in range(NUM_REST)]
    for t in threads:
        t.start()
    for i in range(NUM_GRPC):
        resp = service.stub.Generate(
            pb.GenerateRequest(
                prompt=f"grpc {i}", params=pb.SamplingParams(max_tokens=8, ignore_eos=True)
            ),
            timeout=60,
        )
        assert resp.finish_reason == "length"
    for t in threads:
        t.join(60)


def test_prometheus_scrapes_every_metric_with_ttft_exemplars(tiny_model_dir, tmp_path):
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
        with Service(tiny_model_dir, "--kv-cache-tokens", "2048", env=env) as service:
            proc, prom = _start_prometheus(tmp_path, service.url.removeprefix("http://"))
            try:
                wait_for_http(f"{prom}/-/ready", 60, process=proc)
                wait_until(lambda: _query(prom, "up == 1"), 30, "the first scrape", 0.25)
                start = time.time()
                _load(service)
                total = NUM_REST + NUM_GRPC
                wait_until(
                    lambda: (
                        sum(
                            float(s["value"][1])
                            for s in _query(prom, 'moeserve_requests_total{status="ok"}')
                        )
                        >= total
                    ),
                    30,
                    "scrapes after load",
                    0.25,
                )

                for name in SPEC_SERIES:
                    assert _query(prom, name), f"{name} not in Prometheus"
                by_api = {
                    s["metric"]["api"]: float(s["value"][1])
                    for s in _query(
                        prom, "sum by (api) (moeserve_time_to_first_token_seconds_count)"
                    )
                }
                assert by_api == {"rest": NUM_REST, "grpc": NUM_GRPC}
                experts = _query(prom, "moeserve_moe_expert_tokens_total")
                assert all(
                    set(s["metric"]) <= {"__name__", "instance", "job", "model", "layer", "expert"}
                    for s in experts
                )

                r = httpx.get(
                    f"{prom}/api/v1/query_exemplars",
                    timeout=10,
                    params={
                        "query": "moeserve_time_to_first_token_seconds_bucket",
                        "start": start - 5,
                        "end": time.time() + 5,
                    },
                )
                r.raise_for_status()
                exemplars = [e for series in r.json()["data"] for e in series["exemplars"]]
                trace_ids = {e["labels"]["trace_id"] for e in exemplars}
                assert trace_ids, r.json()
                receiver.wait_for_spans(
                    lambda s: s.trace_id in trace_ids and s.kind == 2, count=len(trace_ids)
                )
                seen = {s.trace_id for s in receiver.spans}
                assert trace_ids <= seen
            finally:
                proc.stop()
