"""bench/decode_floor.py: the bytes a token must read, counted three ways (our engine's modules,
a checkpoint's safetensors headers, a GGUF's tensors), agree on the same model, shrink with the
format, and count routed experts at top_k / num_experts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from gguf import GGUFWriter
from safetensors import safe_open

from bench.decode_floor import (
    checkpoint_weight_bytes_per_token,
    engine_weight_bytes_per_token,
    floor_share,
    gguf_weight_bytes_per_token,
    kv_read_bytes,
    stream_read_bandwidth,
)
from inference import LLMEngine
from inference.checkpoints.demo_model import ensure_demo_model


@pytest.fixture(scope="module")
def tiny():
    return ensure_demo_model("tiny")


def test_engine_and_checkpoint_count_the_same_bf16_bytes(tiny):
    config = json.loads((tiny / "config.json").read_text())
    with safe_open(tiny / "model.safetensors", "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 (not iterable)
    count = {name: math.prod(shape) for name, shape in sizes.items()}
    experts = sum(n for name, n in count.items() if ".experts." in name)
    embed = count["model.embed_tokens.weight"]
    dense = sum(count.values()) - experts - embed
    top_k, num_experts = config["num_experts_per_tok"], config["num_local_experts"]
    by_hand = 2 * (dense + experts * top_k / num_experts + embed / config["vocab_size"])

    bf16 = LLMEngine.from_pretrained(tiny, device="cpu", dtype="bfloat16")
    assert engine_weight_bytes_per_token(bf16) == pytest.approx(by_hand)
    assert checkpoint_weight_bytes_per_token(tiny, 2) == pytest.approx(by_hand)
    assert checkpoint_weight_bytes_per_token(tiny, 4) == pytest.approx(2 * by_hand)  # float32
    int8 = LLMEngine.from_pretrained(tiny, device="cpu", dtype="bfloat16", quantization="int8")
    int4 = LLMEngine.from_pretrained(tiny, device="cpu", dtype="bfloat16", quantization="int4")
    assert engine_weight_bytes_per_token(int4) < engine_weight_bytes_per_token(int8) < 0.6 * by_hand


def test_gguf_bytes_per_token(tmp_path):
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    tensors = {
        "token_embd.weight": np.zeros((100, 8), np.float32),  # one row read: 32 bytes
        "blk.0.attn_q.weight": np.zeros((8, 8), np.float32),  # whole: 256
        "blk.0.ffn_up_exps.weight": np.zeros((4, 16, 8), np.float32),  # 2 of 4: 1,024
        "output.weight": np.zeros((100, 8), np.float32),  # whole: 3,200
    }
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = {"num_experts_per_tok": 2, "num_local_experts": 4, "vocab_size": 100}
    assert gguf_weight_bytes_per_token(path, config) == pytest.approx(32 + 256 + 1024 + 3200)


def test_kv_bytes_and_share():
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_read_bytes(config, 10) == 2 * 2 * 4 * 16 * 10 * 2
    config |= {"num_key_value_heads": 1, "head_dim": 32}
    assert kv_read_bytes(config, 10, 1) == 2 * 2 * 1 * 32 * 10
    assert floor_share(50.0, 2e8, 20e9) == pytest.approx(0.5)  # 50 of the floor's 100 tok/s
    assert stream_read_bandwidth(1 << 22, repeats=2) > 1e8
