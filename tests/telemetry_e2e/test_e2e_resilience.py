"""Telemetry never breaks or slows a request: with the OTLP collector down or slow, REST and
gRPC requests still succeed without a noticeable delay, and the server still exits promptly
on SIGTERM (the span flush at exit is bounded)."""

from __future__ import annotations

import statistics
import time
from concurrent import futures

import grpc
import httpx
import pytest
from e2e_support import Service
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.harness import free_port
from service.proto.moeserve.v1 import inference_pb2 as pb


class _SlowCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        time.sleep(3.0)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.parametrize("collector", ["dead", "slow"])
def test_requests_succeed_without_delay_when_the_collector_is_down_or_slow(
    tiny_model_dir, collector
):
    slow = None
    if collector == "slow":
        slow = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_SlowCollector(), slow)
        port = slow.add_insecure_port("127.0.0.1:0")
        slow.start()
    else:
        port = free_port()  # nothing listens there
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_TRACES_EXPORTER": "otlp",
    }
    try:
        with (
            Service(tiny_model_dir, "--kv-cache-tokens", "2048", env=env) as srv,
            httpx.Client(base_url=srv.url, timeout=30) as http,
        ):
            body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200  # warm-up
            latencies = []
            for i in range(12):
                start = time.perf_counter()
                r = http.post(
                    "/v1/completions",
                    json=body,
                    headers={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"},
                )
                latencies.append(time.perf_counter() - start)
                assert r.status_code == 200 and r.headers["traceparent"].startswith(
                    f"00-{i + 1:032x}-"
                )
            for _ in range(3):
                start = time.perf_counter()
                resp = srv.stub.Generate(
                    pb.GenerateRequest(
                        prompt="hello", params=pb.SamplingParams(max_tokens=8, ignore_eos=True)
                    ),
                    timeout=30,
                )
                latencies.append(time.perf_counter() - start)
                assert resp.finish_reason == "length"
            # a tiny model on CPU: tens of ms per request; an exporter in the way would add seconds
            assert max(latencies) < 2.0 and statistics.median(latencies) < 0.5, latencies
            assert srv.summary(resp.request_id)["status"] == "ok"

            start = time.monotonic()
            srv.proc.terminate()
            assert srv.proc.wait(30) == 0
            assert time.monotonic() - start < 20  # span flush at exit gives up after 5 s
    finally:
        if slow is not None:
            slow.stop(grace=None)
