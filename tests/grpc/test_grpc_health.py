"""grpc.health.v1 follows readiness (SERVING, NOT_SERVING once draining); reflection lists the API."""

from __future__ import annotations

import queue
import threading

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service.proto.moeserve.v1 import inference_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _follow(watch, seen: queue.Queue) -> None:
    try:
        for response in watch:
            seen.put(response.status)
    except grpc.RpcError:  # cancelled at the end of the test
        pass


def _check(channel, service: str = "") -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        .status
    )


def test_health_is_serving_for_the_server_and_the_inference_service(server):
    assert _check(server.channel) == SERVING
    assert _check(server.channel, "moeserve.v1.Inference") == SERVING
    try:
        _check(server.channel, "no.such.Service")
        raise AssertionError("unknown service must not be SERVING")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND


def test_health_turns_not_serving_when_draining_begins(make_server):
    srv = make_server()
    watch = health_pb2_grpc.HealthStub(srv.channel).Watch(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    seen: queue.Queue = queue.Queue()
    threading.Thread(target=_follow, args=(watch, seen), daemon=True).start()
    assert seen.get(timeout=5) == SERVING
    srv.state.draining = True  # what server.py does on SIGTERM
    assert _check(srv.channel) == NOT_SERVING  # Check reads the state live
    assert _check(srv.channel, "moeserve.v1.Inference") == NOT_SERVING
    assert seen.get(timeout=2) == NOT_SERVING  # Watch follows within a poll interval
    srv.state.draining = False
    assert _check(srv.channel) == NOT_SERVING  # draining is for good
    watch.cancel()


def test_mark_not_serving_flips_health_at_once(make_server):
    srv = make_server()
    assert _check(srv.channel) == SERVING
    srv.run(srv.server.mark_not_serving())
    assert (
        _check(srv.channel) == NOT_SERVING
        and _check(srv.channel, "moeserve.v1.Inference") == NOT_SERVING
    )


def test_health_is_not_serving_when_the_engine_is_down(make_server):
    srv = make_server()
    srv.run(srv.engine.shutdown())
    assert _check(srv.channel) == NOT_SERVING
    code = None
    try:
        srv.stub.Generate(
            pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=2)), timeout=5
        )
    except grpc.RpcError as exc:
        code = exc.code()
    assert code == grpc.StatusCode.UNAVAILABLE


def test_reflection_lists_and_describes_the_services(make_server):
    srv = make_server(api_key="k")  # reflection stays open without the key
    db = ProtoReflectionDescriptorDatabase(srv.channel)
    services = set(db.get_services())
    assert {"moeserve.v1.Inference", "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(db)
    service = pool.FindServiceByName("moeserve.v1.Inference")
    assert [m.name for m in service.methods] == [
        "Generate",
        "GenerateStream",
        "Tokenize",
        "ModelInfo",
    ]
    assert service.methods_by_name["GenerateStream"].server_streaming
    fields = pool.FindMessageTypeByName("moeserve.v1.GenerateRequest").fields_by_name
    assert {"prompt", "messages", "params", "request_id"} <= set(fields)
