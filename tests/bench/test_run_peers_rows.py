"""bench/peers/run_peers.py's rows (issue 40): every row runs on a peer, llama.cpp's quantized
rows name their GGUF type, vLLM's dtype follows the CPU, unknown rows are refused, and the
table carries the single-stream floor."""

from __future__ import annotations

import pytest

from bench.peers.run_peers import (
    ENGINES,
    GGUF_TYPES,
    QUANTIZED,
    native_bf16,
    peer_of,
    require_peers,
    single_stream_floor,
    table,
    vllm_dtype,
)
from inference.checkpoints.demo_model import ensure_demo_model


def test_rows_and_their_peers():
    assert {peer_of(e) for e in ENGINES} == {"moeserve", "vllm", "llamacpp"}
    assert {e for e in ENGINES if peer_of(e) == "llamacpp"} == set(GGUF_TYPES)
    assert set(GGUF_TYPES.values()) == {"bf16", "q8_0", "q4_0", "q4_k_m"}
    assert QUANTIZED == {"moeserve-int8": "int8", "moeserve-int4": "int4"}
    with pytest.raises(SystemExit, match="unknown engines: llamacpp-q2_k"):
        require_peers(["moeserve", "llamacpp-q2_k"])


def test_vllm_at_its_best_dtype():
    assert vllm_dtype("auto") == ("bfloat16" if native_bf16() else "float32")
    assert vllm_dtype("float32") == "float32"


def test_the_floor_row():
    model_dir = ensure_demo_model("tiny")
    engines = ["moeserve", "vllm"]
    spec = {"output_len": 128, "vllm_dtype": "float32", "ggufs": {}}
    median = {"moeserve": {"single_stream": 100.0}, "vllm": {"single_stream": 50.0}}
    floor = single_stream_floor(engines, spec, model_dir, {"moeserve": 4e5}, 1e9, median, 128)
    # vLLM in float32 reads twice the bf16 weights and KV
    kv = floor["bytes_per_token"]["moeserve"] - 4e5
    assert floor["bytes_per_token"]["vllm"] - 2 * kv > 4e5
    assert floor["single_stream_share"]["moeserve"] == pytest.approx(100 * (4e5 + kv) / 1e9)
    ratios = {"vllm": {"single_stream": 0.5}}
    text = table(median, ratios, engines, 32, floor)
    assert "| single stream, share of the floor | " in text
    assert f"of {1e9 / (4e5 + kv):,.1f} tok/s" in text
