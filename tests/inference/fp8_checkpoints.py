"""FP8 checkpoints written from a bf16 demo checkpoint in the two layouts published FP8 models
use, and their dequantized bf16 twin (the same weights as bf16: what an FP8 engine must
match).

- "block": DeepSeek-V3 / Qwen3-FP8 style, e4m3 weights with 128 x 128 block scales in
  `<name>_scale_inv` (multiplied in), quantization_config {quant_method: fp8,
  weight_block_size: [128, 128]};
- "channel": compressed-tensors style, e4m3 weights with one `weight_scale` per output
  channel ([N, 1]), quantization_config {quant_method: compressed-tensors, config_groups:
  float 8-bit weights, strategy channel}.

Routers, norms, embeddings and the lm_head stay bf16, as in the published checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.quantization.qweight import FP8, FP8_BLOCK, FP8_MAX

# the projections FP8 checkpoints ship in fp8 (per expert, per projection)
QUANTIZED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * FP8_BLOCK, cols * FP8_BLOCK)[:n, :k].contiguous(), scale


def _channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channel":
        return (q.float() * scale).to(torch.bfloat16)
    expanded = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return (q.float() * expanded[: q.shape[0], : q.shape[1]]).to(torch.bfloat16)


def write_fp8_checkpoint(src: Path, out: Path, twin: Path, layout: str) -> None:
    """An FP8 copy of the bf16 checkpoint `src` in `out`, and its dequantized bf16 twin."""
    for folder in (out, twin):
        shutil.copytree(src, folder, dirs_exist_ok=True)
    fp8, dequantized = {}, {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                w = f.get_tensor(name)
                if w.dim() != 2 or not name.endswith(QUANTIZED):
                    fp8[name] = dequantized[name] = w
                    continue
                if layout == "block":
                    q, scale = _block_quantize(w)
                    fp8[name], fp8[name + "_scale_inv"] = q, scale
                else:
                    q, scale = _channel_quantize(w)
                    fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale"] = q, scale
                dequantized[name] = _dequantize(q, scale, layout)
    for folder, tensors in ((out, fp8), (twin, dequantized)):
        for stale in folder.glob("*.safetensors*"):
            stale.unlink()
        save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if layout == "block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                    "input_activations": {"type": "float", "num_bits": 8, "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    (out / "config.json").write_text(json.dumps(config, indent=2))
