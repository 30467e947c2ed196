"""loadtest/bench_serving.py: its arithmetic (fast unit tests) and real runs against the real
server, with token counts checked against the server's own Prometheus counters."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "loadtest" / "bench_serving.py"
# the key comes from the command line only
ENV = {k: v for k, v in os.environ.items() if k not in ("MOESERVE_API_KEY", "OPENAI_API_KEY")}

# every field the JSON result promises (metric fields for ttft, tpot, itl and e2el)
FIELDS = {
    "date",
    "base_url",
    "endpoint",
    "model",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "slo",
    "warmup",
    "completed",
    "failed",
    "failures_by_status",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "slowest_requests",
    "server_metrics",
    "requests",
} | {
    f"{stat}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p90", "p99")
}


# --- arithmetic -------------------------------------------------------------------------------


def test_parse_slo(bench_serving):
    assert bench_serving.parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert bench_serving.parse_slo("e2el:2000") == {"e2el": 2000.0}
    for bad in ("ttft", "itl:5", "ttft:x", "tpot:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.parse_slo(bad)


def test_percentiles_match_numpy_linear(bench_serving):
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert bench_serving.percentile(values, q) == pytest.approx(np.percentile(values, q))
    stats = bench_serving.summarize([0.001, 0.002, 0.003], [50, 90, 99])
    assert stats["mean"] == pytest.approx(2.0) and stats["p50"] == pytest.approx(2.0)


def test_gamma_arrivals(bench_serving):
    assert bench_serving.arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    for burstiness in (1.0, 0.5, 4.0):
        offsets = bench_serving.arrival_offsets(4000, 20.0, burstiness, 0)
        assert offsets == sorted(offsets) and offsets[0] == 0.0
        gaps = [b - a for a, b in itertools.pairwise(offsets)]
        mean = sum(gaps) / len(gaps)
        cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
        assert mean == pytest.approx(1 / 20, rel=0.08)
        assert cv2 == pytest.approx(1 / burstiness, rel=0.2)  # gamma: CV^2 = 1/shape


def test_goodput_needs_every_slo(bench_serving):
    r = bench_serving.RequestResult(
        index=0, trace_id="t", request_id="r", ok=True, ttft=0.1, e2el=1.1, completion_tokens=11
    )  # TPOT 100 ms
    assert bench_serving.meets_slo(r, {"ttft": 100, "tpot": 100})
    assert not bench_serving.meets_slo(r, {"ttft": 99, "tpot": 100})
    assert not bench_serving.meets_slo(r, {"ttft": 100, "tpot": 99})
    assert not bench_serving.meets_slo(r, {"e2el": 1000})


def test_token_counter_parsing(bench_serving):
    text = """# TYPE moeserve_prompt_tokens counter
moeserve_prompt_tokens_total{model="m",api="rest"} 12.0
moeserve_prompt_tokens_total{model="m",api="grpc"} 3.0
moeserve_prompt_tokens_created{model="m",api="rest"} 1.7e9
vllm:generation_tokens_total{model_name="m"} 40
"""
    assert bench_serving.parse_token_counters(text) == {
        "prompt_tokens": 15.0,
        "generation_tokens": 40.0,
    }


# --- real runs --------------------------------------------------------------------------------


def _rest_token_counters(url: str) -> dict[str, float] | None:
    r = httpx.get(url + "/metrics", timeout=10)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    out = {"prompt": 0.0, "generation": 0.0}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            for key in out:
                if (
                    sample.name == f"moeserve_{key}_tokens_total"
                    and sample.labels.get("api") == "rest"
                ):
                    out[key] += sample.value
    return out


def _bench(live_server, tmp_path: Path, *args: str) -> tuple[dict, str]:
    result = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--base-url",
        live_server.url,
        "--result-file",
        str(result),
        "--api-key",
        live_server.api_key,
        "--save-detailed",
        "--progress",
        "on",
        *args,
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return json.loads(result.read_text()), output


@pytest.mark.slow
def test_fixed_concurrency_run_matches_server_counters(live_server, tmp_path):
    before = _rest_token_counters(live_server.url)
    n, in_len, out_len, warmups = 20, 24, 12, 2
    data, output = _bench(
        live_server,
        tmp_path,
        "--num-prompts",
        str(n),
        "--input-len",
        str(in_len),
        "--output-len",
        str(out_len),
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--num-warmups",
        str(warmups),
        "--slo",
        "ttft:60000,tpot:60000",
        "--server-metrics",
    )
    assert FIELDS <= set(data), sorted(FIELDS - set(data))
    assert data["completed"] == n and data["failed"] == 0 and data["failures_by_status"] == {}
    # token ids as the prompt: exact prompt lengths; ignore_eos: exact output lengths
    assert data["total_input_tokens"] == n * in_len
    assert data["total_output_tokens"] == n * out_len
    assert data["input_tokens_from"] == "usage" and data["output_tokens_from"] == "usage"
    assert data["warmup"]["completed"] == warmups
    assert data["max_concurrent_requests"] <= 4
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])  # loose SLOs
    assert data["output_throughput"] == pytest.approx(n * out_len / data["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < data[f"p50_{m}_ms"] <= data[f"p90_{m}_ms"] <= data[f"p99_{m}_ms"], m
    assert data["p50_ttft_ms"] < data["p50_e2el_ms"]

    requests = data["requests"]
    assert len(requests) == n
    trace_ids = [r["trace_id"] for r in requests]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids) and len(set(trace_ids)) == n
    for r in requests:  # a server that continues our trace returns the same trace id
        assert r["server_trace_id"] == r["trace_id"]
        assert len(r["itl"]) >= 1
    slow = data["slowest_requests"]
    assert slow[0]["e2el_ms"] == max(r["e2el"] for r in requests) * 1000
    assert slow[0]["trace_id"] in output  # printed next to the report
    assert "[bench] 20/20 done" in output

    after = _rest_token_counters(live_server.url)
    if before is None or after is None:
        pytest.skip("the server has no /metrics yet: token counts not compared")
    # the server's counters moved by exactly the benchmark's tokens plus the warm-ups'
    assert (
        after["prompt"] - before["prompt"]
        == data["total_input_tokens"] + data["warmup"]["prompt_tokens"]
    )
    assert after["generation"] - before["generation"] == (
        data["total_output_tokens"] + data["warmup"]["output_tokens"]
    )
    assert data["server_metrics"]["match"] is True


@pytest.mark.slow
def test_poisson_chat_run(live_server, tmp_path):
    data, _ = _bench(
        live_server,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "8",
        "--input-len",
        "20",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        "--ignore-eos",
        "--request-rate",
        "8",
        "--burstiness",
        "0.5",
        "--num-warmups",
        "0",
        "--slo",
        "ttft:0.001",
        "--seed",
        "3",
    )
    assert data["completed"] == 8 and data["failed"] == 0
    assert data["request_rate"] == 8 and data["burstiness"] == 0.5
    assert data["prompt_format"] == "auto" and data["warmup"]["requests"] == 0
    starts = sorted(r["start"] for r in data["requests"])
    assert starts[-1] > 0.05  # arrivals spread out, not all at t=0
    outputs = [r["output_tokens"] for r in data["requests"]]
    assert all(4 <= o <= 12 for o in outputs) and sum(outputs) == data["total_output_tokens"]
    assert data["request_goodput"] == 0 and data["slo_attainment"] == 0  # 1 us TTFT: never met


@pytest.mark.slow
def test_failures_are_counted_by_status(live_server, tmp_path):
    """No API key: every request is a 401, counted as such, and the exit status is 1."""
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--base-url",
            live_server.url,
            "--model",
            live_server.model,
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--num-warmups",
            "0",
            "--result-file",
            str(result),
            "--progress",
            "off",
        ],
        check=False,
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(result.read_text())
    assert data["completed"] == 0 and data["failed"] == 3
    assert data["failures_by_status"] == {"401": 3}
