"""8-bit (and int4) weights and KV cache through the server (issues 19, 40): the flags and their MOESERVE_*
variables reach the engine, /metrics and gRPC ModelInfo report the formats and the bytes,
requests are served on both APIs, and a bad value is refused at start-up."""

from __future__ import annotations

import argparse

import grpc
import httpx
import pytest

from bench.harness import InProcessServer
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from service.settings import add_arguments, from_namespace
from tests.service.conftest import make_settings


@pytest.fixture(scope="module")
def quantized(tiny_model_dir):
    settings = make_settings(
        tiny_model_dir,
        dtype="bfloat16",
        grpc_port=0,
        kv_cache_tokens=None,
        kv_cache_bytes=1 << 21,
        quantization="int8",
        kv_cache_dtype="int8",
    )
    with InProcessServer(settings) as srv:
        yield srv


def test_metrics_report_the_formats_and_bytes(quantized):
    text = httpx.get(quantized.url + "/metrics").text
    info = next(line for line in text.splitlines() if line.startswith("moeserve_model_info{"))
    assert 'quantization="int8"' in info and 'kv_cache_dtype="int8"' in info
    assert 'dtype="bfloat16"' in info and info.endswith(" 1.0")
    memory = {
        line.split('kind="')[1].split('"')[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("moeserve_model_memory_bytes{")
    }
    engine = quantized.engine
    assert memory == {"weights": engine.weight_bytes, "kv_cache": engine.kv_cache_bytes}
    assert 0 < engine.kv_cache_bytes <= 1 << 21


def test_grpc_model_info_reports_them(quantized):
    with grpc.insecure_channel(quantized.grpc_target) as channel:
        info = inference_pb2_grpc.InferenceStub(channel).ModelInfo(pb.ModelInfoRequest())
    engine = quantized.engine
    assert (info.quantization, info.kv_cache_dtype) == ("int8", "int8")
    assert info.weight_bytes == engine.weight_bytes
    assert (info.kv_cache_tokens, info.kv_cache_bytes) == (
        engine.kv_cache_tokens,
        engine.kv_cache_bytes,
    )


def test_a_quantized_server_answers_on_both_apis(quantized):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0}
    model = httpx.get(quantized.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(quantized.url + "/v1/completions", json={**body, "model": model}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    with grpc.insecure_channel(quantized.grpc_target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(
                prompt="hello there", params=pb.SamplingParams(max_tokens=5, temperature=0)
            ),
            timeout=60,
        )
    assert len(reply.token_ids) == 5


def test_flags_and_environment_variables_name_the_formats(monkeypatch):
    monkeypatch.setenv("MOESERVE_KV_CACHE_DTYPE", "fp8_e4m3")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = from_namespace(parser.parse_args(["--quantization", "fp8", "--kv-cache-bytes", "9"]))
    assert (settings.quantization, settings.kv_cache_dtype, settings.kv_cache_bytes) == (
        "fp8",
        "fp8_e4m3",
        9,
    )
    assert settings.engine_limits()["quantization"] == "fp8"
    assert from_namespace(parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


def test_an_int4_server_reports_int4_and_answers(tiny_model_dir):
    settings = make_settings(tiny_model_dir, dtype="bfloat16", grpc_port=0, quantization="int4")
    with InProcessServer(settings) as srv:
        text = httpx.get(srv.url + "/metrics").text
        info = next(line for line in text.splitlines() if line.startswith("moeserve_model_info{"))
        assert 'quantization="int4"' in info
        with grpc.insecure_channel(srv.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            assert stub.ModelInfo(pb.ModelInfoRequest()).quantization == "int4"
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_bad_combination_is_refused_at_start_up(tiny_model_dir):
    settings = make_settings(tiny_model_dir, kv_cache_tokens=4096, kv_cache_bytes=1 << 20)
    with pytest.raises(Exception, match="kv_cache_bytes"), InProcessServer(settings):
        pass
