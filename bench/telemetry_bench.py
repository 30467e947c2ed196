"""`make bench`, telemetry overhead: REST serving throughput with tracing + metrics + logs on
against all of them off, same server flags and same load, printed as a ratio (target >= 0.97).

On:  spans exported over OTLP/gRPC to a local sink (a real exporter doing real work), JSON
     request logs to a file, /metrics scraped with exemplars once a second (as Prometheus
     would).
Off: MOESERVE_TELEMETRY=0 (no spans, no metrics, no request logs) and OTEL_TRACES_EXPORTER=none.

Load: `concurrency` clients streaming completions (SSE, EOS ignored) until `requests` are
done, after a warm-up. Rounds alternate off/on so drift hits both; each reports output
tokens/s and the ratio uses the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.rest_load import closed_loop, start_server, streaming_body
from inference.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts and drops what it gets."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def _load(url: str, args: argparse.Namespace, num_requests: int) -> tuple[float, int]:
    body = streaming_body("The history of the mixture of experts " * 4, args.max_tokens)
    return await closed_loop(url, [body] * num_requests, args.concurrency)


def _scrape(url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.wait(1.0):
            client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})


def run_round(model: Path, args: argparse.Namespace, telemetry: bool, sink_port: int, tmp: Path) -> dict:
    if telemetry:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
               "MOESERVE_TELEMETRY": "1"}
    else:
        env = {"OTEL_TRACES_EXPORTER": "none", "MOESERVE_TELEMETRY": "0"}
    log = tmp / f"server-{'on' if telemetry else 'off'}-{time.monotonic_ns()}.log"
    flags = ["--device", args.device, "--max-num-seqs", str(args.concurrency)]
    proc, url = start_server(model, flags, env, log)
    stop = threading.Event()
    try:
        asyncio.run(_load(url, args, args.concurrency))  # warm-up
        if telemetry:
            threading.Thread(target=_scrape, args=(url, stop), daemon=True).start()
        elapsed, tokens = asyncio.run(_load(url, args, args.requests))
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
    lines = sum(1 for line in log.read_text().splitlines() if '"request finished"' in line)
    return {"telemetry": telemetry, "seconds": elapsed, "output_tokens": tokens,
            "tokens_per_s": tokens / elapsed, "summary_log_lines": lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    parser.add_argument("--out", type=Path, default=RESULTS / "telemetry_bench.json")
    args = parser.parse_args(argv)

    model = ensure_demo_model(args.preset)
    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                for telemetry in (False, True):
                    rounds.append(run_round(model, args, telemetry, sink_port, Path(tmp)))
                    r = rounds[-1]
                    print(f"telemetry {'on ' if telemetry else 'off'}: {r['tokens_per_s']:8.1f} tok/s "
                          f"({r['output_tokens']} tokens in {r['seconds']:.2f} s)", flush=True)
    finally:
        server.stop(grace=None)
    on = statistics.median(r["tokens_per_s"] for r in rounds if r["telemetry"])
    off = statistics.median(r["tokens_per_s"] for r in rounds if not r["telemetry"])
    result = {"ratio_on_over_off": on / off, "target": 0.97, "on_tokens_per_s": on,
              "off_tokens_per_s": off, "spans_exported": sink.spans, "rounds": rounds,
              "config": {**{k: str(v) for k, v in vars(args).items()}, "machine": platform.platform()}}
    print(f"telemetry overhead: on/off throughput = {on / off:.3f} (target >= 0.97); "
          f"{sink.spans} spans exported")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
