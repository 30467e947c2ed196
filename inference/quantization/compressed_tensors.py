"""compressed-tensors checkpoints of 4-bit integer weights (quant_method "compressed-tensors",
format "pack-quantized": llm-compressor's W4A16), as the compressed-tensors library packs
them: per module `weight_packed` int32 [N, K/8] (eight levels a word along the inputs, the
lowest bits first, each stored as value + 8), `weight_scale` [N, G], `weight_shape` [2],
and where asymmetric `weight_zero_point` int32 [N/8, G] (eight signed zero points a word
along the outputs, + 8 likewise); `weight_g_idx` [K] in act-order checkpoints of older
releases. w = (value - zero_point) * scale = (level - (zero_point + 8)) * scale.
Stacked experts ([E, N, K/8], transformers 5's fused layout) unpack the same way.

Served: 4-bit int weights, strategies group and channel, symmetric or not, weight-only
(no input_activations). Refused, naming the field: other bit widths, float types, other
strategies (tensor, block), activation quantization, other formats of integer weights.
(Float 8-bit weights are the fp8 path's: loader.checkpoint_quantization.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.quantization.published import (
    Int4Levels,
    UnservedVariant,
    group_order,
    require,
    symmetric_or_zeros,
    unpack_nibbles,
)

SERVED = "pack-quantized int 4-bit weights, strategy group or channel, no input_activations"
WEIGHT = "weight_packed"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass(frozen=True, slots=True)
class PackedScheme:
    groups: frozenset[int]  # the config groups' group sizes (-1: per channel)


def is_int4(qc: dict) -> bool:
    """Whether a compressed-tensors config quantizes weights to integers (this module's)
    rather than floats (fp8's)."""
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    return any(w.get("type", "int") == "int" for w in weights)


def scheme(qc: dict) -> PackedScheme:
    sizes = set()
    for key, g in (qc.get("config_groups") or {}).items():
        where = f"config_groups.{key}."
        fmt = g.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise UnservedVariant(f"quantization_config.{where}format", fmt, SERVED)
        w = g.get("weights") or {}
        wf = where + "weights."
        require(w, "num_bits", (4,), SERVED, where=wf)
        require(w, "type", ("int",), SERVED, where=wf)
        strategy = require(w, "strategy", ("group", "channel"), SERVED, where=wf)
        if w.get("dynamic"):
            raise UnservedVariant(f"quantization_config.{wf}dynamic", w["dynamic"], SERVED)
        if g.get("input_activations"):
            raise UnservedVariant(
                f"quantization_config.{where}input_activations", g["input_activations"], SERVED
            )
        size = w.get("group_size") if strategy == "group" else -1
        if not isinstance(size, int) or not (size == -1 or (size > 0 and size % 8 == 0)):
            raise UnservedVariant(f"quantization_config.{wf}group_size", size, "a multiple of 8")
        sizes.add(size)
    if not sizes:
        raise UnservedVariant("quantization_config.config_groups", None, SERVED)
    return PackedScheme(frozenset(sizes))


def unpack(tensors: dict[str, torch.Tensor], s: PackedScheme, name: str) -> list[Int4Levels]:
    """One module's tensors -> its Int4Levels (one per expert of a stacked [E, N, K] module,
    one for a matrix)."""
    for part in ("weight_packed", "weight_scale"):
        if part not in tensors:
            raise ValueError(f"compressed-tensors module {name!r} has no {part}")
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    if packed.dtype != torch.int32 or packed.dim() not in (2, 3):
        raise ValueError(f"{name}: weight_packed must be int32 [N, K/8] or [E, N, K/8]")
    stacked = packed.dim() == 3
    if "weight_shape" in tensors:
        k = int(tensors["weight_shape"].flatten()[-1])
    else:
        k = packed.shape[-1] * 8
    n, groups = packed.shape[-2], scale.shape[-1]
    if tuple(scale.shape) != (*packed.shape[:-2], n, groups) or -(-k // 8) != packed.shape[-1]:
        raise ValueError(
            f"{name}: weight_scale {tuple(scale.shape)} / weight_packed "
            f"{tuple(packed.shape)} do not fit a weight of {k} inputs"
        )
    group = k if groups == 1 else -(-k // groups)
    fits = -1 in s.groups or any(size >= k for size in s.groups) if groups == 1 else None
    if not fits and group not in s.groups:
        raise ValueError(f"{name}: groups of {group} inputs, not among the config's")
    levels = unpack_nibbles(packed)[..., :k]
    zeros = torch.full(scale.shape, 8, dtype=torch.int16)
    if "weight_zero_point" in tensors:
        zp = tensors["weight_zero_point"]
        if zp.dtype == torch.int32:  # packed along the outputs
            zp = unpack_nibbles(zp.transpose(-1, -2).contiguous()).transpose(-1, -2)[..., :n, :]
            zp = zp.to(torch.int16)  # stored + 8 already: the level domain
        else:  # unpacked signed zero points (int8 / float)
            zp = zp.to(torch.int16) + 8
        if tuple(zp.shape) != tuple(scale.shape):
            raise ValueError(f"{name}: weight_zero_point {tuple(zp.shape)} does not fit scales")
        zeros = zp
    perm = None
    if "weight_g_idx" in tensors and not stacked:
        perm = group_order(tensors["weight_g_idx"], k, group, f"{name}.weight_g_idx")
        if perm is not None:
            levels = levels[..., perm]
    mats = [(levels, scale, zeros)] if not stacked else list(zip(levels, scale, zeros))
    return [
        Int4Levels(lv.contiguous(), sc.float().contiguous(), symmetric_or_zeros(z), group, perm)
        for lv, sc, z in mats
    ]
