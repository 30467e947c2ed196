"""The single-stream floor (issue 40): a decode step of one sequence must read every weight the
token uses once, so no engine beats bytes a token must read / memory bandwidth. The peer bench
and quant_bench report single stream as a share of that floor:

    share = measured tokens/s x bytes a token reads / measured bandwidth

- bandwidth: a streaming read measured in the same run (`stream_read_bandwidth`: the sum of a
  tensor far larger than any cache, with the engines' thread count, best of a few);
- bytes a token reads, in the format the engine holds: its dense weights (attention, routers,
  norms, lm_head) whole, its routed experts' at top_k / num_experts, one row of the embedding
  (a tied embedding is read whole, as the lm_head), plus the KV cache at the run's mean context.
  From the engine's own modules for ours (their int8 / int4 weights with scales), from the
  GGUF's tensors for llama.cpp, from the checkpoint's tensors at the serving dtype for vLLM.

Decode reads the same weights in a batch too, so the floor matters where the weights do not sit
in the last-level cache: the `medium` demo preset.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

STREAM_BYTES = 1 << 30  # 1 GiB: many times any last-level cache


def stream_read_bandwidth(nbytes: int = STREAM_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a streaming read: the best of `repeats` sums of an `nbytes` float32
    tensor, on torch's threads (the engines' own)."""
    import torch

    data = torch.ones(nbytes // 4, dtype=torch.float32)
    data.sum()  # pages touched, threads up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def kv_read_bytes(config: dict, context: float, element_bytes: int = 2) -> float:
    """KV cache bytes one decode step reads at `context` tokens (keys and values, every layer)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * context * element_bytes


def _share(of: str, config: dict) -> float:
    """The share of a tensor of kind `of` ("experts", "embed", "dense") a token reads."""
    if of == "experts":
        return config["num_experts_per_tok"] / _num_experts(config)
    if of == "embed" and not config.get("tie_word_embeddings"):
        return 1 / config["vocab_size"]
    return 1.0


def _num_experts(config: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return config[key]
    raise ValueError("config.json names no expert count")


def engine_weight_bytes_per_token(engine) -> float:
    """Weight bytes a token reads in one of our engines, in the format it holds them (8- and
    4-bit weights with their scales), from the model's own modules."""
    import torch

    from inference.quantization.qweight import QWeight

    args = engine.args
    config = {
        "num_experts_per_tok": args.top_k,
        "num_experts": args.num_experts,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,  # a tied lm_head is a module of its own, read whole
    }
    total = 0.0
    for name, module in engine.executor.model.named_modules():
        parts = name.split(".")
        kind = "experts" if "experts" in parts else "embed" if "embed" in parts else "dense"
        held = [p.numel() * p.element_size() for p in module.parameters(recurse=False)]
        for value in module.__dict__.values():
            if isinstance(value, QWeight):
                held.append(value.nbytes)
            elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                held.append(value.numel() * value.element_size())
        total += sum(held) * _share(kind, config)
    return total


def gguf_weight_bytes_per_token(path: str | Path, config: dict) -> float:
    """Weight bytes a token reads in a GGUF (llama.cpp's names: *_exps the routed experts,
    token_embd the embedding, read whole when there is no separate output tensor)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    tied = {**config, "tie_word_embeddings": "output.weight" not in tensors}
    total = 0.0
    for name, size in tensors.items():
        kind = "experts" if "_exps" in name else "embed" if name.startswith("token_embd") else ""
        total += size * _share(kind or "dense", tied)
    return total


def checkpoint_weight_bytes_per_token(model_dir: str | Path, element_bytes: int) -> float:
    """Weight bytes a token reads of a Hugging Face checkpoint served at `element_bytes` a
    value (vLLM's dtype), from the safetensors headers (nothing loaded)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    total = 0.0
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            kind = (
                "experts" if ".experts." in name else "embed" if "embed_tokens" in name else "dense"
            )
            total += count * element_bytes * _share(kind, config)
    return total


def floor_share(tokens_per_s: float, bytes_per_token: float, bandwidth: float) -> float:
    """Measured single-stream rate over the floor's rate (bandwidth / bytes a token reads)."""
    return tokens_per_s * bytes_per_token / bandwidth
