"""`make bench`, telemetry overhead: REST serving throughput with tracing + metrics + logs on
against all of them off, same server flags and same load, printed as a ratio (target >= 0.97).
`--compare inspector` measures the request inspector the same way (target >= 0.99).

telemetry (the request inspector off on both sides, --no-inspector):
  On:  spans exported over OTLP/gRPC to a local sink (a real exporter doing real work), JSON
       request logs to a file, /metrics scraped with exemplars every 5 s (the interval of the
       moeserve job in deploy/prometheus/prometheus.yml); and everything issue 37 added:
       per-request metrics asked for by every request (--enable-per-request-metrics,
       include_metrics), the cost gauges (--cost-per-hour), the OTel GenAI server metrics
       (OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental) exported over OTLP to the
       same sink every 5 s.
  Off: MOESERVE_TELEMETRY=0 (no spans, no metrics, no request logs), OTEL_TRACES_EXPORTER=none.
inspector (telemetry on as above on both sides):
  On:  the inspector recording (the default), and its page open: the engine view, the request
       list and the newest request's detail fetched every 2 s, as /inspect does.
  Off: --no-inspector.

Load: `concurrency` clients streaming completions (SSE, EOS ignored) until `requests` are
done. Both servers are started and warmed up before anything is timed (each idle while the
other is measured); rounds alternate off/on (ABBA) and the ratio is the median of the per-round
on/off ratios, so that the drift of a shared VM hits both sides of each pair.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.harness import ServerProcess
from bench.rest_load import closed_loop, streaming_body
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"
SCRAPE_INTERVAL_S = 5.0  # as deploy/prometheus/prometheus.yml scrapes moeserve
PAGE_INTERVAL_S = 2.0  # as the /inspect page refreshes
TARGETS = {"telemetry": 0.98, "inspector": 0.99}  # on/off throughput


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts and drops what it gets."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricSink(metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP metrics receiver that drops what it gets (the GenAI server metrics)."""

    def Export(self, request, context):
        return metrics_service_pb2.ExportMetricsServiceResponse()


async def _load(
    url: str, args: argparse.Namespace, num_requests: int, include_metrics: bool = False
) -> tuple[float, int]:
    body = streaming_body("The history of the mixture of experts " * 4, args.max_tokens)
    if include_metrics:  # per-request metrics, on the stream's last chunk
        body["include_metrics"] = True
    return await closed_loop(url, [body] * num_requests, args.concurrency)


def _scrape(url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.wait(SCRAPE_INTERVAL_S):
            client.get(
                "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
            )


def _watch_inspector(url: str, stop: threading.Event) -> None:
    """What an open /inspect page asks for."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.wait(PAGE_INTERVAL_S):
            client.get("/inspect/api/engine").raise_for_status()
            listing = client.get("/inspect/api/requests", params={"limit": 200})
            rows = listing.raise_for_status().json()["requests"]
            if rows:
                client.get(f"/inspect/api/requests/{rows[0]['id']}").raise_for_status()


def _telemetry_on(args: argparse.Namespace, on: bool) -> bool:
    return on or args.compare == "inspector"


def server_for(
    model: Path, args: argparse.Namespace, on: bool, sink_port: int, tmp: Path
) -> ServerProcess:
    """The server with the compared feature on or off (not started yet), logging to a file in
    `tmp`."""
    if _telemetry_on(args, on):
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
            "MOESERVE_TELEMETRY": "1",
            "OTEL_SEMCONV_STABILITY_OPT_IN": "http,gen_ai_latest_experimental",
            "OTEL_METRIC_EXPORT_INTERVAL": "5000",
        }
    else:
        env = {"OTEL_TRACES_EXPORTER": "none", "MOESERVE_TELEMETRY": "0"}
    log = tmp / f"server-{'on' if on else 'off'}.log"
    flags = ["--device", args.device, "--max-num-seqs", str(args.concurrency)]
    if args.compare == "telemetry" or not on:
        flags.append("--no-inspector")
    if _telemetry_on(args, on):
        flags += ["--enable-per-request-metrics", "--cost-per-hour", "1.0"]
    return ServerProcess(model, *flags, env=env, log_path=log, start_timeout=300, stop_timeout=60)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_core_pid(pid: int) -> int:
    """The server's one child, its engine core process (listed under the thread that started it)."""
    children = [
        c
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    return int(children[0])


def run_round(url: str, pid: int, args: argparse.Namespace, on: bool) -> dict:
    """Throughput, and the CPU per output token of the API process (where telemetry and the
    inspector run) and of the engine core."""
    stop = threading.Event()
    if _telemetry_on(args, on):
        threading.Thread(target=_scrape, args=(url, stop), daemon=True).start()
    if args.compare == "inspector" and on:
        threading.Thread(target=_watch_inspector, args=(url, stop), daemon=True).start()
    core = engine_core_pid(pid)
    api_cpu, core_cpu = cpu_seconds(pid), cpu_seconds(core)
    try:
        elapsed, tokens = asyncio.run(_load(url, args, args.requests, _telemetry_on(args, on)))
    finally:
        stop.set()
    return {
        "on": on,
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "api_cpu_ms_per_token": (cpu_seconds(pid) - api_cpu) / tokens * 1e3,
        "engine_cpu_ms_per_token": (cpu_seconds(core) - core_cpu) / tokens * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="off/on pairs")
    parser.add_argument("--compare", choices=sorted(TARGETS), default="telemetry")
    parser.add_argument("--out", type=Path, help="default: bench/results/<compare>_bench.json")
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / f"{args.compare}_bench.json"
    name, target = args.compare, TARGETS[args.compare]

    model = ensure_demo_model(args.preset)
    sink = _Sink()
    sink_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, sink_server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricSink(), sink_server)
    sink_port = sink_server.add_insecure_port("127.0.0.1:0")
    sink_server.start()
    rounds, pairs = [], []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stack.callback(sink_server.stop, None)  # last: after both servers are stopped
        servers: dict[bool, ServerProcess] = {}
        for on in (False, True):
            server = stack.enter_context(server_for(model, args, on, sink_port, Path(tmp)))
            warm = _telemetry_on(args, on)
            asyncio.run(_load(server.url, args, args.concurrency, warm))  # warm-up
            servers[on] = server
        for r in range(args.rounds):
            rates = {}
            for on in (False, True) if r % 2 == 0 else (True, False):
                server = servers[on]
                rounds.append(run_round(server.url, server.pid, args, on))
                rates[on] = rounds[-1]["tokens_per_s"]
                print(
                    f"{name} {'on ' if on else 'off'}: {rates[on]:8.1f} tok/s, CPU per "
                    f"output token: API process {rounds[-1]['api_cpu_ms_per_token']:.3f} ms, engine core "
                    f"{rounds[-1]['engine_cpu_ms_per_token']:.2f} ms",
                    flush=True,
                )
            pairs.append(rates[True] / rates[False])
        summary_lines = sum(
            1 for line in servers[True].log_text().splitlines() if '"request finished"' in line
        )
    ratio = statistics.median(pairs)
    on = statistics.median(r["tokens_per_s"] for r in rounds if r["on"])
    off = statistics.median(r["tokens_per_s"] for r in rounds if not r["on"])
    result = {
        "compare": name,
        "ratio_on_over_off": ratio,
        "target": target,
        "on_tokens_per_s": on,
        "off_tokens_per_s": off,
        "pair_ratios": pairs,
        "spans_exported": sink.spans,
        "summary_log_lines": summary_lines,
        "rounds": rounds,
        "config": {**{k: str(v) for k, v in vars(args).items()}, "machine": platform.platform()},
    }
    print(
        f"{name} overhead: on/off throughput = {ratio:.3f} (median of {args.rounds} paired rounds; "
        f"target >= {target}); {sink.spans} spans exported, {summary_lines} request summary lines"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
