"""REST and gRPC in one `MoeServer`: their requests share the engine's continuous batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx

from bench.harness import InProcessServer
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from service.settings import Settings


def test_rest_and_grpc_requests_are_batched_together(model_path):
    settings = Settings(
        model=str(model_path),
        served_model_name="demo-tiny",
        port=0,
        grpc_port=0,
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        kv_cache_tokens=8192,
        max_num_seqs=8,
        drain_timeout=5,
    )
    steps: list[tuple[int, list[str]]] = []
    with InProcessServer(settings) as srv:
        srv.engine.add_stats_listener(lambda s: steps.append((s.batch_size, s.request_ids)))
        channel = grpc.insecure_channel(srv.grpc_target)
        stub = inference_pb2_grpc.InferenceStub(channel)
        # Long gRPC streams are running (first token seen) when the REST requests arrive.
        streams = [
            stub.GenerateStream(
                pb.GenerateRequest(
                    prompt=f"grpc request {i}",
                    request_id=f"grpc-batch-{i}",
                    params=pb.SamplingParams(max_tokens=400, ignore_eos=True),
                ),
                timeout=60,
            )
            for i in range(2)
        ]
        firsts = [next(stream) for stream in streams]  # may hold more than one token (deltas merge)

        def rest(i: int) -> dict:
            body = {"model": "demo-tiny", "prompt": f"rest request {i}", "max_tokens": 8}
            url = f"{srv.url}/v1/completions"
            return httpx.post(url, json=body | {"ignore_eos": True}, timeout=30).json()

        with ThreadPoolExecutor(2) as pool:
            rest_bodies = list(pool.map(rest, range(2)))
        grpc_tokens = [
            len(first.token_ids) + sum(len(c.token_ids) for c in stream)
            for first, stream in zip(firsts, streams)
        ]
        channel.close()
    assert all(b["usage"]["completion_tokens"] == 8 for b in rest_bodies), rest_bodies
    assert grpc_tokens == [400, 400]
    mixed = [
        (size, ids)
        for size, ids in steps
        if size >= 2
        and any(i.startswith("grpc-batch-") for i in ids)
        and any(i.startswith("cmpl-") for i in ids)
    ]
    assert mixed, steps
