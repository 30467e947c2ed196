"""A random-weight checkpoint given a multi-token-prediction layer (DeepSeek-V3 / GLM-4.5
layout: model.layers.<num_hidden_layers> with enorm, hnorm, eh_proj, shared_head and a decoder
block), for speculative method "mtp": the demo checkpoints write none. Tests and
bench/spec_bench.py serve them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_with_mtp_layer(
    src: Path, out: Path, self_predicting: bool = False, own_head: bool = True
) -> Path:
    """A copy of the single-file checkpoint `src` (a demo's) in `out` whose config.json
    declares one MTP layer
    (num_nextn_predict_layers) and whose weights hold it: a copy of the last decoder layer,
    eh_proj drawn at random (seeded), the target's lm_head as shared_head.head.

    self_predicting: the MTP layer computes exactly what the target computes for the next
    token, so its draft is the target's own next token. The target is made to depend on its
    last token alone (every attention output and the MLPs before the last layer zeroed), its
    embedding rows of unit RMS (so enorm leaves them as they are), and eh_proj = [I, 0] takes
    the embedding of the token after the row's: the MTP block (a copy of the last layer) then
    sees what the target's last layer sees one position later.

    own_head False: the layer has neither shared_head.head nor embed_tokens, as GLM-4.6's
    checkpoints publish it (the target's lm_head and embedding serve)."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(out / "model.safetensors")
    if self_predicting:
        for name, t in tensors.items():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            outputs = name.endswith(("o_proj.weight", "down_proj.weight", "down_proj"))
            if layer is not None and (
                name.endswith("o_proj.weight") or (outputs and int(layer) < n - 1)
            ):
                t.zero_()
        embed = tensors["model.embed_tokens.weight"]
        embed /= embed.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-6)  # pad: 0
        eh_proj = torch.cat((torch.eye(d), torch.zeros(d, d)), dim=1)
    else:
        generator = torch.Generator().manual_seed(0)
        eh_proj = torch.randn(d, 2 * d, generator=generator) / (2 * d) ** 0.5
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            tensors[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = t.clone()
    tensors |= {
        f"model.layers.{n}.enorm.weight": torch.ones(d),
        f"model.layers.{n}.hnorm.weight": torch.ones(d),
        f"model.layers.{n}.eh_proj.weight": eh_proj.to(tensors["lm_head.weight"].dtype),
        f"model.layers.{n}.shared_head.norm.weight": torch.ones(d),
        f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
        f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    if not own_head:
        del tensors[f"model.layers.{n}.shared_head.head.weight"]
        del tensors[f"model.layers.{n}.embed_tokens.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
