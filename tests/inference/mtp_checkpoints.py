"""Checkpoints with multi-token-prediction layers, as DeepSeek-V3, GLM-4.5 and MiniMax-M2 publish
them: layers num_hidden_layers and up (each a decoder layer plus enorm, hnorm, eh_proj and a
shared_head), which the engine loads past and does not run (models/args.py Family.mtp_layers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inference import LLMEngine, SamplingParams


def with_mtp_layers(src: Path, out: Path, count: int = 1) -> Path:
    """A copy of checkpoint `src` in `out` with `count` MTP layers after its last layer (each
    a copy of the last layer and the MTP block's own tensors)."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(out / "model.safetensors")
    last = [(name, t) for name, t in tensors.items() if name.startswith(f"model.layers.{n - 1}.")]
    for i in range(n, n + count):
        for name, t in last:
            tensors[name.replace(f"layers.{n - 1}.", f"layers.{i}.")] = t.clone()
        tensors |= {
            f"model.layers.{i}.enorm.weight": torch.ones(d),
            f"model.layers.{i}.hnorm.weight": torch.ones(d),
            f"model.layers.{i}.eh_proj.weight": torch.zeros(d, 2 * d),
            f"model.layers.{i}.shared_head.norm.weight": torch.ones(d),
            f"model.layers.{i}.shared_head.head.weight": torch.zeros(cfg["vocab_size"], d),
        }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def check_mtp_layers_load_and_are_not_run(src: Path, tmp: Path, count: int = 1) -> None:
    """The checkpoint with MTP layers loads, builds num_hidden_layers layers and decodes what
    the checkpoint without them decodes."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for path in (src, with_mtp_layers(src, tmp / "with-mtp", count)):
        engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=64)
        outputs.append(engine.generate([[5, 6, 7, 8, 9]], params)[0].token_ids)
        assert (
            engine.args.num_layers
            == json.loads((src / "config.json").read_text())["num_hidden_layers"]
        )
    assert outputs[0] == outputs[1]
