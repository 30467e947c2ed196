"""4-bit checkpoints made by the library that publishes the format, and that library's own
dequantization of them (the reference a loader is held to).

- GPTQ (auto_gptq format), AWQ (GEMM packing) and compressed-tensors pack-quantized: made by
  Intel's AutoRound (`auto-round`, round-to-nearest: iters=0, no calibration run), which
  exports all three as published models are (GPTQModel needs torch >= 2.14.1, AutoAWQ
  needs triton and llm-compressor pins transformers <= 5.17: none installs beside our
  torch 2.13 / transformers 5.25). References: AutoRound's torch GPTQ layer
  (auto_round_extension.torch.qlinear_torch_zp.QuantLinear: AutoGPTQ's v1 dequantization,
  g_idx and all), AutoRound's copy of AutoAWQ's dequantize_gemm, and the compressed-tensors
  library's own PackedQuantizationCompressor.decompress.
- Act-order GPTQ: no installable library writes it (GPTQModel, AutoGPTQ; AutoRound 0.16.1
  exports desc_act false with in-order g_idx, and its own loader refuses other g_idx); the
  g_idx checkpoint is AutoRound's GPTQ one with its inputs reordered (levels and g_idx
  permuted the way act-order writes them, one order for the modules that read one input),
  and the reference is still AutoRound's g_idx-aware layer (AutoGPTQ's dequantization).

The demo models' tiny preset (and a dense llama) is widened to 128 inputs so groups of 128
exist."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.checkpoints.demo_model import family_preset, write_demo_model
from inference.executor.loader import int4_reader

# (format argument of AutoRound's export, symmetric, group size; -1: per channel)
VARIANTS = {
    "gptq-sym-g128": ("auto_gptq", True, 128),
    "gptq-asym-g128": ("auto_gptq", False, 128),
    "gptq-asym-channel": ("auto_gptq", False, -1),
    "gptq-sym-g32": ("auto_gptq", True, 32),
    "gptq-asym-g32": ("auto_gptq", False, 32),
    "awq-g128": ("auto_awq", False, 128),
    "awq-sym-g128": ("auto_awq", True, 128),
    "ct-sym-g128": ("llm_compressor", True, 128),
    "ct-asym-channel": ("llm_compressor", False, -1),
    "autoround-sym-g128": ("auto_round", True, 128),  # AutoRound's own format
}
ARCH = "qwen2_moe"  # experts, attention and a dense MLP (the shared expert)


def source_model(root: Path, arch: str = ARCH) -> Path:
    """A float32 demo checkpoint of `arch` (a demo family, or "llama": a dense
    LlamaForCausalLM over the demo tokenizer) with 128 hidden inputs (groups of 128 fit)."""
    out = root / ("source" if arch == ARCH else f"source-{arch}")
    if (out / "config.json").is_file():
        return out
    if arch == "llama":
        from tests.inference.tiny_gguf import random_llama

        tokenizer = source_model(root)
        model = random_llama(tokenizer, seed=1, hidden_size=128, intermediate_size=256, head_dim=32)
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, out / name)
        return out
    p = dataclasses.replace(
        family_preset("tiny", arch), hidden=128, head_dim=32, ffn=256, shared_ffn=256
    )
    write_demo_model(out, preset=p, arch=arch)
    return out


def autoround_checkpoint(src: Path, out: Path, variant: str) -> Path:
    """`src` quantized by AutoRound (round-to-nearest) and exported in `variant`'s format."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fmt, sym, group = VARIANTS[variant]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    text = ["def f(x):\n    return x + 1\n" * 40] * 4  # unused by RTN; no dataset download
    ar = AutoRound(
        model, tok, bits=4, group_size=group, sym=sym, iters=0, disable_opt_rtn=True,
        dataset=text, nsamples=4, seqlen=32,
    )  # fmt: skip
    ar.quantize_and_save(str(out / "export"), format=fmt)
    (folder,) = [p.parent for p in (out / "export").glob("*/config.json")]
    return folder


def read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def quantization_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


# ---- the libraries' dequantization --------------------------------------------------------


def gptq_reference(t: dict[str, torch.Tensor], module: str, qc: dict) -> torch.Tensor:
    """w [N, K] float32 by AutoRound's GPTQ (v1) torch layer, g_idx and all: its forward on
    the identity. (Its g_idx branch, AutoGPTQ's, reads only the first K output columns'
    scales: the outputs go through it K columns at a time.)"""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    qweight = t[f"{module}.qweight"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    rows = []
    for start in range(0, n, k):
        cols = slice(start, min(n, start + k))
        width = cols.stop - start
        layer = QuantLinear(4, qc["group_size"], k, width, bias=False)
        layer.qweight = qweight[:, cols].contiguous()
        layer.qzeros = t[f"{module}.qzeros"][:, start // 8 : cols.stop // 8].contiguous()
        layer.scales = t[f"{module}.scales"][:, cols].float().contiguous()
        if f"{module}.g_idx" in t:  # (AutoRound's own format has none: groups in order)
            layer.g_idx = t[f"{module}.g_idx"]
        with torch.no_grad():
            rows.append(layer(torch.eye(k)).t().float())
    return torch.cat(rows)


def awq_reference(t: dict[str, torch.Tensor], module: str, qc: dict) -> torch.Tensor:
    """w [N, K] float32 by AutoAWQ's dequantize_gemm (AutoRound's copy)."""
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    scales = t[f"{module}.scales"].float()
    k = t[f"{module}.qweight"].shape[0]
    group = k if qc["group_size"] == -1 else qc["group_size"]
    w = dequantize_gemm(t[f"{module}.qweight"], t[f"{module}.qzeros"], scales, 4, group)
    return w.t().float()


def ct_reference(t: dict[str, torch.Tensor], module: str, qc: dict) -> torch.Tensor:
    """w [N, K] float32 by the compressed-tensors library's own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    state = {k.removeprefix(module + "."): v for k, v in t.items() if k.startswith(module + ".")}
    state["weight_scale"] = state["weight_scale"].float()
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()


REFERENCES = {
    "gptq": gptq_reference,
    "awq": awq_reference,
    "compressed-tensors": ct_reference,
    "auto-round": gptq_reference,  # its auto_round:auto_gptq packing is GPTQ v1's
}
MAIN_TENSOR = {
    "gptq": "qweight",
    "awq": "qweight",
    "compressed-tensors": "weight_packed",
    "auto-round": "qweight",
}


def quantized_modules(path: Path) -> list[str]:
    method = quantization_config(path)["quant_method"]
    suffix = "." + MAIN_TENSOR[method]
    return sorted(k.removesuffix(suffix) for k in read_all(path) if k.endswith(suffix))


def dequantized_twin(path: Path, out: Path) -> Path:
    """A plain float32 copy of the 4-bit checkpoint `path`: each quantized module's weight
    as its library dequantizes it, the rest as it is, no quantization_config."""
    qc = quantization_config(path)
    method = qc["quant_method"]
    reference = REFERENCES[method]
    shutil.copytree(path, out)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    tensors = read_all(path)
    plain = {}
    modules = set(quantized_modules(path))
    parts = set(int4_reader(qc)[0].PARTS)
    for name, value in tensors.items():
        module, _, part = name.rpartition(".")
        if module not in modules or part not in parts:  # biases stay beside the weight
            plain[name] = value.float() if value.is_floating_point() else value
    for module in modules:
        plain[f"{module}.weight"] = reference(tensors, module, qc).contiguous()
    save_file(plain, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


# the modules that read one input (GPTQ's act-order order comes from that input's Hessian,
# so theirs is one order): q/k/v, and each MLP's or expert's gate/up
_SAME_INPUT = re.compile(r"\.(?:(?:q|k|v)_proj|(?:gate|up)_proj)$")


def _input_of(module: str) -> str:
    return _SAME_INPUT.sub(lambda m: ".qkv" if m.group(0)[1] in "qkv" else ".gate_up", module)


def act_order_gptq(
    path: Path, out: Path, experts: bool, seed: int = 0, one_order_an_input: bool = True
) -> Path:
    """AutoRound's GPTQ checkpoint `path` rewritten as act-order writes one: the inputs of
    the attention and dense MLP modules (and the experts' with `experts`) in a random order,
    g_idx saying each input's group, desc_act true. Modules that read one input (q/k/v,
    gate/up) share their order, as GPTQ's (one Hessian) do, unless one_order_an_input is
    False. (Its weights are other weights, each input's levels moved to another input: a
    valid act-order checkpoint, which the reference layer dequantizes by its g_idx.)"""
    shutil.copytree(path, out)
    tensors = read_all(path)
    g = torch.Generator().manual_seed(seed)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    orders: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in tensors if n.endswith(".qweight")):
        module = name.removesuffix(".qweight")
        if ".experts." in module and not experts:
            continue
        qweight, g_idx = tensors[name].to(torch.int64), tensors[f"{module}.g_idx"]
        k = qweight.shape[0] * 8
        levels = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(k, -1)
        key = _input_of(module) if one_order_an_input else module
        perm = orders.setdefault(key, torch.randperm(k, generator=g))
        levels, g_idx = levels[perm], g_idx[perm]
        words = (levels.reshape(k // 8, 8, -1) << shifts.view(1, 8, 1)).sum(1)
        tensors[name] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        tensors[f"{module}.g_idx"] = g_idx.contiguous()
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out
