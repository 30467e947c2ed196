"""Loading a Hugging Face checkpoint folder: config, safetensors weights (one file or sharded
with an index), tokenizer. Checkpoint tensors are mapped onto our fused parameters
(q/k/v -> wqkv, gate/up -> w13, experts stacked; MLA projections one to one) by the rules of
the checkpoint's family (models/), and checked for presence and shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from inference.errors import ModelLoadError
from inference.hf_overrides import apply_hf_overrides, hf_overrides
from inference.models.args import Family, ModelArgs
from inference.quantization import qweight as quant
from inference.quantization.qweight import QWeight

_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_PREFIX = re.compile(r"model\.layers\.(\d+)\.(.+)")
# FP8 checkpoints: each fp8 weight's scales sit beside it (read with it); static activation
# scales are not used (activations are quantized per token at run time)
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def load_hf_config(path: Path, overrides: str | dict | None = None):
    """The checkpoint's transformers config, with vLLM's --hf-overrides applied
    (inference/hf_overrides.py)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (StrictDataclassError, KeyError, ValueError) as exc:  # transformers validates fields
        raise ModelLoadError(f"{path}/config.json: {exc}") from exc
    apply_hf_overrides(cfg, hf_overrides(overrides))
    return cfg


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(
            f"{path} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"
        )
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, hf_config, tokenizer) -> set[int]:
    """Every id that ends generation: the config's, the tokenizer's and the generation
    config's (chat models often list their end-of-turn token only there)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    except OSError:
        pass
    for value in sources:
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{path}: shard(s) named in the index are missing: {', '.join(missing)}"
            )
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return files


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none)."""
    m = _LAYER_PREFIX.fullmatch(name)
    return int(m.group(1)) if m else -1


def _target(name: str, args: ModelArgs, weights) -> tuple[str, int | None, str | None, object]:
    """A checkpoint tensor -> (our parameter, expert index or None, part or None, the rule's
    convert or None), by the family's WeightRules (models/args.py); None for a name no rule
    knows."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name], None, None, None
    m = _LAYER_PREFIX.fullmatch(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    moe_prefix = "mlp.moe." if args.shared_expert_intermediate_size else "mlp."
    for rule in weights:
        pm = rule.pattern.fullmatch(rest)
        if pm:
            groups = pm.groups()
            expert = int(groups[0]) if groups and groups[0].isdigit() else None
            target = rule.target.format(*groups, moe=moe_prefix)
            part = None if rule.part is None else rule.part.format(*groups)
            return f"layers.{layer}.{target}", expert, part, rule.convert
    return None


def _rows(param_name: str, part: str | None, param: torch.Tensor, args: ModelArgs) -> slice:
    if part is None:
        return slice(None)
    if part in ("q", "k", "v"):
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        start = {"q": 0, "k": q, "v": q + kv}[part]
        return slice(start, start + (q if part == "q" else kv))
    half = param.shape[0] // 2  # gate rows then up rows (of a weight or a bias)
    return slice(0, half) if part == "gate" else slice(half, 2 * half)


def checkpoint_quantization(hf_config) -> str:
    """What the checkpoint itself is quantized as: "fp8" for FP8 checkpoints (quant_method
    fp8, or compressed-tensors with float 8-bit weights), "none" for plain ones; any other
    scheme is refused (its weights would not load as published)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return "none"
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method in ("fp8", "mxfp4"):  # mxfp4: gpt-oss's experts, dequantized at load
        return method
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "fp8"
    raise ModelLoadError(
        f"checkpoint quantized with {method!r} ({qc.get('format') or ''}); supported: plain "
        "bf16/float16/float32 checkpoints, FP8 ones (fp8, compressed-tensors float8) and "
        "gpt-oss's mxfp4"
    )


class _Fp8Parts:
    """The fp8 values and per-row group scales of a fused parameter, filled part by part
    (q/k/v, gate/up, experts) as the checkpoint's tensors come."""

    def __init__(self, param: torch.Tensor) -> None:
        self.data = torch.zeros(param.shape, dtype=torch.uint8)
        self.scale: torch.Tensor | None = None  # [..., N, G]
        self.group: int | None = None
        self.mixed = False  # parts with different groups: quantized again from bf16 instead

    def fill(self, index, rows: slice, q: torch.Tensor, scale: torch.Tensor, group: int) -> None:
        if self.group is None:
            self.group = group
            groups = -(-self.data.shape[-1] // group)
            self.scale = torch.zeros(*self.data.shape[:-1], groups, dtype=torch.float32)
        if group != self.group:
            self.mixed = True
            return
        dest = self.data if index is None else self.data[index]
        dest[rows] = q.view(torch.uint8)
        (self.scale if index is None else self.scale[index])[rows] = scale

    def qweight(self) -> QWeight | None:
        if self.mixed:
            return None
        k = self.data.shape[-1]
        scale = self.scale.transpose(-1, -2).contiguous()
        return QWeight("fp8", self.data.view(quant.FP8), scale, self.group, k)


def load_weights(
    model, path: Path, args: ModelArgs, family: Family, keep_fp8: bool = False
) -> dict[str, QWeight]:
    """Copies every checkpoint tensor into the model, by the family's rules; raises on a
    missing, unknown-shaped or absent weight. A family with multi-token-prediction layers
    (Family.mtp_layers) loads past the checkpoint's layers after its last decoder layer: they
    are not run (speculative decoding will). Parameters must already have their final dtype and device. FP8 tensors
    are dequantized into the parameters; with keep_fp8, also returned as they were published
    (parameter name -> QWeight, row-major) for engines serving fp8 weights."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # parameter -> number of elements written
    files = checkpoint_files(path)
    located: dict[str, Path] = {}  # tensor name -> file (a weight's scale may sit in another shard)
    for file in files:
        with safe_open(file, framework="pt") as f:
            located.update(dict.fromkeys(f.keys(), file))
    fp8: dict[str, _Fp8Parts] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith(_SCALE_SUFFIXES) or (
                    family.mtp_layers and _layer_index(name) >= args.num_layers
                ):
                    continue
                mxfp4 = name.endswith(_MXFP4_BLOCKS)
                if name.endswith(_MXFP4_SCALES) and _blocks_of(name) in located:
                    continue  # read with its blocks
                tgt = _target(name.removesuffix(_MXFP4_BLOCKS), args, family.weights)
                if tgt is None:
                    if ".rotary_emb." in name:
                        continue
                    raise ModelLoadError(
                        f"{file.name}: unexpected weight {name!r} for {args.architecture}"
                    )
                pname, expert, part, convert = tgt
                if pname not in params:
                    raise ModelLoadError(
                        f"{file.name}: weight {name!r} has no place in this model "
                        f"(checkpoint and config.json disagree)"
                    )
                param = params[pname].data
                dest = param[expert] if expert is not None else param
                rows = _rows(pname, part, dest, args)
                dest = dest[rows]
                tensor = _mxfp4_weight(name, f, located) if mxfp4 else f.get_tensor(name)
                if convert is not None:
                    tensor = convert(tensor)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json"
                    )
                if tensor.dtype == quant.FP8:
                    scales, group = _fp8_scales(name, tensor, located)
                    w = QWeight("fp8", tensor, scales.transpose(0, 1), group, tensor.shape[-1])
                    dest.copy_(w.dequantize(dest.dtype))
                    if keep_fp8 and tensor.dim() == 2:
                        parts = fp8.setdefault(pname, _Fp8Parts(params[pname]))
                        parts.fill(expert, rows, tensor, scales, group)
                else:
                    dest.copy_(tensor)
                filled[pname] = filled.get(pname, 0) + tensor.numel()
    if args.tie_word_embeddings and "lm_head.weight" not in filled:
        params["lm_head.weight"].data.copy_(params["embed.weight"].data)
        filled["lm_head.weight"] = params["lm_head.weight"].numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise ModelLoadError(
            f"{path}: checkpoint lacks weights for: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    kept = {name: parts.qweight() for name, parts in fp8.items()}
    return {name: w for name, w in kept.items() if w is not None}


# gpt-oss's MXFP4 tensors: NAME_blocks [..., N, K/32, 16] (two e2m1 values a byte, the low
# nibble first) and NAME_scales [..., N, K/32] (e8m0: a power of two, biased by 127)
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _blocks_of(scales_name: str) -> str:
    return scales_name.removesuffix(_MXFP4_SCALES) + _MXFP4_BLOCKS


def _mxfp4_weight(name: str, f, located: dict[str, Path]) -> torch.Tensor:
    """An MXFP4 checkpoint tensor dequantized (bfloat16) in the layout its unquantized
    checkpoints store: [..., K, N] (transformers' convert_moe_packed_tensors)."""
    scales_name = name.removesuffix(_MXFP4_BLOCKS) + _MXFP4_SCALES
    if scales_name not in located:
        raise ModelLoadError(f"MXFP4 weight {name!r} has no {scales_name!r} beside it")
    blocks = f.get_tensor(name)
    with safe_open(located[scales_name], framework="pt") as g:
        scales = g.get_tensor(scales_name)
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16:
        raise ModelLoadError(
            f"{name}: MXFP4 blocks must be uint8 [..., K/32, 16], got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelLoadError(
            f"{scales_name}: MXFP4 scales must be uint8 of shape {tuple(blocks.shape[:-1])} "
            f"(one per block of 32 in {name}), got {scales.dtype} {tuple(scales.shape)}"
        )
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = torch.ldexp(values.flatten(-2), scales.to(torch.int32).sub(127).unsqueeze(-1))
    return values.flatten(-2).to(torch.bfloat16).transpose(-1, -2).contiguous()


def _fp8_scales(
    name: str, tensor: torch.Tensor, located: dict[str, Path]
) -> tuple[torch.Tensor, int]:
    """The per-row group scales [N, G] of an fp8 checkpoint tensor and its group size."""
    if tensor.dim() != 2:
        raise ModelLoadError(f"fp8 weight {name!r} is not a matrix")
    for suffix, inverse_block in ((".weight_scale_inv", True), (".weight_scale", False)):
        scale_name = name.removesuffix(".weight") + suffix
        if scale_name in located:
            with safe_open(located[scale_name], framework="pt") as f:
                scale = f.get_tensor(scale_name)
            try:
                return quant.checkpoint_fp8_scales(scale, tuple(tensor.shape), inverse_block)
            except ValueError as exc:
                raise ModelLoadError(f"{scale_name}: {exc}") from exc
    raise ModelLoadError(f"fp8 weight {name!r} has no weight_scale_inv or weight_scale beside it")
