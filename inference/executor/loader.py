"""Loading a Hugging Face checkpoint folder: config, safetensors weights (one file or sharded
with an index), tokenizer. Checkpoint tensors are mapped onto our fused parameters
(q/k/v -> wqkv, gate/up -> w13, experts stacked; MLA projections one to one) by the rules of
the checkpoint's family (models/), and checked for presence and shape."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from inference.errors import ModelLoadError
from inference.hf_overrides import apply_hf_overrides, hf_overrides
from inference.models.args import Family, ModelArgs
from inference.models.mtp import MTP_OWN_WEIGHTS, MTP_SHARED_WEIGHTS
from inference.quantization import act_order, autoround, awq, compressed_tensors, gptq, mxfp4
from inference.quantization import qweight as quant
from inference.quantization.published import Int4Levels, UnservedVariant
from inference.quantization.qweight import QWeight

log = structlog.get_logger("inference.loader")

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


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor name the checkpoint's safetensors files hold (read from their headers)."""
    names: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return names


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none)."""
    m = _LAYER_PREFIX.fullmatch(name)
    return int(m.group(1)) if m else -1


def _skipped_mtp_tensor(name: str, args: ModelArgs) -> bool:
    """A tensor of the checkpoint's multi-token-prediction layers that is not loaded: all of
    them, but the first layer's own where the "mtp" drafter runs it (ModelArgs.mtp), whose
    embed_tokens is the target's (shared, as vLLM shares it)."""
    layer = _layer_index(name)
    if layer < args.num_layers:
        return False
    if not args.mtp or layer > args.num_layers:
        return True
    return name.removeprefix(f"model.layers.{layer}.") in MTP_SHARED_WEIGHTS


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
    prefix = f"layers.{layer}."
    if args.mtp and layer == args.num_layers:  # the MTP layer (models/mtp.py)
        if rest in MTP_OWN_WEIGHTS:
            return f"mtp.{MTP_OWN_WEIGHTS[rest]}", None, None, None
        prefix = "mtp.block."
    moe_prefix = "mlp.moe." if args.shared_expert_intermediate_size else "mlp."
    for rule in weights:
        pm = rule.pattern.fullmatch(rest)
        if pm:
            groups = pm.groups()
            expert = int(groups[0]) if groups and groups[0].isdigit() else None
            target = rule.target.format(*groups, moe=moe_prefix)
            part = None if rule.part is None else rule.part.format(*groups)
            return f"{prefix}{target}", expert, part, rule.convert
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


# the published 4-bit formats: each one's module (its config, its tensors, their unpacking)
INT4_FORMATS = {
    "gptq": gptq,
    "awq": awq,
    "compressed-tensors": compressed_tensors,
    "auto-round": autoround,  # GPTQ's or AWQ's packing (autoround.packing_module)
}


def quantization_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    return None if qc is None else qc if isinstance(qc, dict) else qc.to_dict()


def checkpoint_quantization(hf_config) -> str:
    """What the checkpoint itself is quantized as: "fp8" for FP8 checkpoints (quant_method
    fp8, or compressed-tensors with float 8-bit weights), the 4-bit formats as published
    ("gptq", "awq", "compressed-tensors" pack-quantized, gpt-oss's "mxfp4"), "none" for
    plain ones; any other scheme, or a variant of these we do not serve, is refused naming
    the config field."""
    qc = quantization_config(hf_config)
    if qc is None:
        return "none"
    method = qc.get("quant_method")
    if method in ("fp8", "mxfp4"):
        return method
    if method == "compressed-tensors" and not compressed_tensors.is_int4(qc):
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "fp8"
    if method in INT4_FORMATS:
        int4_scheme(qc)  # refuses the variants we do not serve
        return method
    raise ModelLoadError(
        f"quantization_config.quant_method = {method!r} ({qc.get('format') or ''}) is not "
        "served; served: plain bf16/float16/float32 checkpoints, FP8 ones (fp8, "
        "compressed-tensors float8), 4-bit gptq, awq, compressed-tensors pack-quantized and "
        "gpt-oss's mxfp4"
    )


def int4_reader(qc: dict):
    """(the module that unpacks this 4-bit checkpoint's tensors, its scheme)."""
    scheme = int4_scheme(qc)
    fmt = INT4_FORMATS[qc["quant_method"]]
    return (autoround.packing_module(qc) if fmt is autoround else fmt), scheme


def int4_scheme(qc: dict):
    """The published 4-bit format's scheme (its module's scheme()), refusing variants we do
    not serve with a ModelLoadError naming the config field."""
    try:
        return INT4_FORMATS[qc["quant_method"]].scheme(qc)
    except UnservedVariant as exc:
        raise ModelLoadError(f"{qc['quant_method']} checkpoint: {exc}") from exc


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


class _Int4Parts:
    """The levels, scales and zero points of a fused parameter, filled part by part (q/k/v,
    gate/up, experts) as a published 4-bit checkpoint's modules come."""

    def __init__(self, param: torch.Tensor, name: str) -> None:
        self.name = name
        self.levels = torch.zeros(param.shape, dtype=torch.uint8)
        self.scales: torch.Tensor | None = None  # [..., N, G]
        self.zeros: torch.Tensor | None = None  # [..., N, G], 8 where symmetric
        self.group: int | None = None
        # act-order: each matrix's input order (expert index or None -> perm or None), which
        # its parts (q/k/v, gate/up: one input) must share to be gathered once
        self.orders: dict[int | None, torch.Tensor | None] = {}
        self.orders_differ = False

    def fill(self, index, rows: slice, part: Int4Levels) -> None:
        if self.group is None:
            self.group = part.group
            groups = -(-self.levels.shape[-1] // part.group)
            shape = (*self.levels.shape[:-1], groups)
            self.scales = torch.zeros(shape, dtype=torch.float32)
            self.zeros = torch.full(shape, 8, dtype=torch.int16)
        if part.group != self.group:
            raise ModelLoadError(
                f"{self.name}: its parts come in groups of {self.group} and {part.group} "
                "inputs (one fused weight takes one group size)"
            )
        if index not in self.orders:
            self.orders[index] = part.perm
        elif not _same_order(self.orders[index], part.perm):
            self.orders_differ = True
        at = (lambda t: t[rows]) if index is None else (lambda t: t[index][rows])
        at(self.levels).copy_(part.levels)
        at(self.scales).copy_(part.scales)
        if part.zeros is not None:
            at(self.zeros).copy_(part.zeros)

    def qweight(self) -> QWeight | None:
        """The parameter in 4 bits; None where its parts' act-order input orders differ (one
        gather cannot serve them: it is served from its dequantized weights instead)."""
        if self.orders_differ:
            return None
        zeros = None if bool((self.zeros == 8).all()) else self.zeros
        perm = None
        if any(p is not None for p in self.orders.values()):
            k = self.levels.shape[-1]
            if self.levels.dim() == 2:
                perm = self.orders[None]
            else:  # experts in order (or none) keep the identity
                perm = torch.arange(k).repeat(self.levels.shape[0], 1)
                for e, p in self.orders.items():
                    if p is not None:
                        perm[e] = p
        return quant.int4_from_levels(self.levels, self.scales, zeros, self.group, perm=perm)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _int4_module(name: str, f, located: dict[str, Path], fmt, scheme) -> list[Int4Levels]:
    """A published 4-bit module's tensors (NAME = its main tensor, fmt.WEIGHT) unpacked: one
    Int4Levels per matrix (several for a stacked [E, N, K] module)."""
    module = name.removesuffix("." + fmt.WEIGHT)
    tensors = {fmt.WEIGHT: f.get_tensor(name)}
    for part in fmt.PARTS:
        full = f"{module}.{part}"
        if part != fmt.WEIGHT and full in located:
            with safe_open(located[full], framework="pt") as g:
                tensors[part] = g.get_tensor(full)
    try:
        unpacked = fmt.unpack(tensors, scheme, module)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    return unpacked if isinstance(unpacked, list) else [unpacked]


def _int4_part_of(name: str, located: dict[str, Path], fmt) -> bool:
    """Whether NAME is a side tensor of a published 4-bit module (read with its main one)."""
    module, _, part = name.rpartition(".")
    return part in fmt.PARTS and part != fmt.WEIGHT and f"{module}.{fmt.WEIGHT}" in located


def _rowwise(convert):
    """A rule's convert (checkpoint layout [..., K, N] -> ours [..., N, K], as gpt-oss's
    transposed experts need) applied to row-major [..., N, X] tensors: levels, scales."""
    return lambda t: convert(t.transpose(-1, -2))


def load_weights(
    model, path: Path, args: ModelArgs, family: Family, keep_published: bool = False
) -> dict[str, QWeight]:
    """Copies every checkpoint tensor into the model, by the family's rules; raises on a
    missing, unknown-shaped or absent weight. A family with multi-token-prediction layers
    (Family.mtp_layers) loads past the checkpoint's layers after its last decoder layer, but
    the first one's where the "mtp" drafter runs it (ModelArgs.mtp: into model.mtp).
    Parameters must already have their final dtype and device. Quantized tensors (FP8; GPTQ, AWQ, compressed-tensors and MXFP4 in 4 bits)
    are dequantized into the parameters, as the format's own library dequantizes them; with
    keep_published, also returned as they were published (parameter name -> QWeight,
    row-major) for engines serving them so. What the checkpoint keeps in 16 bits stays so."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # parameter -> number of elements written
    files = checkpoint_files(path)
    located: dict[str, Path] = {}  # tensor name -> file (a weight's scale may sit in another shard)
    for file in files:
        with safe_open(file, framework="pt") as f:
            located.update(dict.fromkeys(f.keys(), file))
    qc = _config_quantization(path)
    fmt = scheme = None
    method = qc.get("quant_method") if qc else None
    # (float 8-bit compressed-tensors checkpoints take the fp8 path)
    if method in INT4_FORMATS and (
        method != "compressed-tensors" or compressed_tensors.is_int4(qc)
    ):
        fmt, scheme = int4_reader(qc)
    fp8: dict[str, _Fp8Parts] = {}
    int4: dict[str, _Int4Parts] = {}
    kept: dict[str, QWeight] = {}  # whole parameters as published (mxfp4 experts)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith(_SCALE_SUFFIXES) or (
                    family.mtp_layers and _skipped_mtp_tensor(name, args)
                ):
                    continue
                if fmt is not None and _int4_part_of(name, located, fmt):
                    continue  # read with its module's main tensor
                is_mxfp4 = name.endswith(mxfp4.BLOCKS)
                if name.endswith(mxfp4.SCALES) and mxfp4.blocks_name(name) in located:
                    continue  # read with its blocks
                is_int4 = fmt is not None and name.endswith("." + fmt.WEIGHT)
                weight_name = (
                    name.removesuffix(fmt.WEIGHT) + "weight"
                    if is_int4
                    else name.removesuffix(mxfp4.BLOCKS)
                )
                tgt = _target(weight_name, args, family.weights)
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
                published = None
                if is_int4:
                    unpacked = _int4_module(name, f, located, fmt, scheme)
                    tensor = torch.stack([u.dequantize() for u in unpacked])
                    tensor = tensor if len(unpacked) > 1 else tensor[0]
                    if convert is not None:
                        raise ModelLoadError(
                            f"{name}: {args.architecture}'s layout of this weight is not "
                            f"served in {qc['quant_method']}"
                        )
                elif is_mxfp4:
                    published = _mxfp4_weight(name, f, located)
                    tensor = published.dequantize(torch.bfloat16).transpose(-1, -2)
                else:
                    tensor = f.get_tensor(name)
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
                    if keep_published and tensor.dim() == 2:
                        parts = fp8.setdefault(pname, _Fp8Parts(params[pname]))
                        parts.fill(expert, rows, tensor, scales, group)
                else:
                    dest.copy_(tensor)
                if keep_published and is_int4:
                    parts = int4.setdefault(pname, _Int4Parts(params[pname], name))
                    if len(unpacked) > 1:  # a stacked module: every expert at once
                        for e, u in enumerate(unpacked):
                            parts.fill(e, rows, u)
                    else:
                        parts.fill(expert, rows, unpacked[0])
                if keep_published and published is not None:
                    if expert is not None or part is not None:
                        raise ModelLoadError(f"{name}: MXFP4 weights come whole per parameter")
                    kept[pname] = _converted(published, convert)
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
    if fmt is not None and not any(n.endswith("." + fmt.WEIGHT) for n in located):
        raise ModelLoadError(
            f"{path}: quantization_config.quant_method is {qc['quant_method']!r} but no "
            f"weight is stored so (no *.{fmt.WEIGHT} tensor)"
        )
    for pname, parts in int4.items():
        w = _served_int4(pname, parts)
        if w is not None:
            kept[pname] = w
    _fold_down_orders(kept, params)
    for pname, parts in fp8.items():
        w = parts.qweight()
        if w is not None:
            kept[pname] = w
    return kept


def _config_quantization(path: Path) -> dict | None:
    """config.json's quantization_config (the loader reads the tensors it describes)."""
    try:
        return json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None


def _served_int4(pname: str, parts: _Int4Parts) -> QWeight | None:
    """A published 4-bit parameter as served: its levels in 4 bits, act-order ones with their
    input order (QWeight.perm: the activations gathered into it); None (served from its
    dequantized 16-bit weights, said at start-up) where fused parts (q/k/v, gate/up) come in
    different act-order input orders."""
    w = parts.qweight()
    if w is None:
        log.warning(
            "act-order weight served dequantized",
            weight=pname,
            reason="its fused parts' g_idx give different input orders (one gather a weight)",
        )
    return w


_DOWN = re.compile(r"(.*)\.w2(\.weight)?")


def _fold_down_orders(kept: dict[str, QWeight], params: dict) -> None:
    """Each act-order down projection (an MLP's w2, experts' w2) whose gate/up weight is
    served in 4 bits without a bias: its input order folded into gate/up's rows
    (act_order.fold_down_order), so no gather runs for it; others keep their gather."""
    for pname, w2 in list(kept.items()):
        found = _DOWN.fullmatch(pname)
        if w2.perm is None or found is None:
            continue
        base, weight = found.group(1), found.group(2) or ""
        up = f"{base}.w13{weight}"
        bias = f"{base}.w13.bias" if weight else f"{base}.b13"
        w13 = kept.get(up)
        if w13 is None or w13.fmt != "int4" or w13.packed or params.get(bias) is not None:
            continue
        kept[up], kept[pname] = act_order.fold_down_order(w13, w2)


def _converted(w: QWeight, convert) -> QWeight:
    """A row-major published weight put in our layout by its rule's convert (gpt-oss's
    transposed, interleaved experts): the same row permutation of its values and scales."""
    if convert is None:
        return w
    data = _rowwise(convert)(w.data)
    scale = _rowwise(convert)(w.scale.transpose(-1, -2)).transpose(-1, -2)
    return dataclasses.replace(w, data=data.contiguous(), scale=scale.contiguous())


def _mxfp4_weight(name: str, f, located: dict[str, Path]) -> QWeight:
    """An MXFP4 checkpoint tensor (NAME_blocks and its NAME_scales) as an mxfp4 QWeight,
    row-major [..., N, K] in the tensor's own row order."""
    scales_name = mxfp4.scales_name(name)
    if scales_name not in located:
        raise ModelLoadError(f"MXFP4 weight {name!r} has no {scales_name!r} beside it")
    with safe_open(located[scales_name], framework="pt") as g:
        scales = g.get_tensor(scales_name)
    try:
        return mxfp4.weight(name, f.get_tensor(name), scales)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


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
