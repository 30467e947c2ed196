"""GPTQ checkpoints as AutoGPTQ, GPTQModel and AutoRound write them (quant_method "gptq"):
per module `qweight` int32 [K/8, N] (eight 4-bit levels a word along the inputs, the
lowest bits first), `qzeros` int32 [G, N/8] (eight zero points a word along the outputs),
`scales` fp16 [G, N] and `g_idx` int32 [K] (each input's group: act-order checkpoints
order the inputs by their Hessian, so groups are not contiguous). w = (level - zero) *
scale. Checkpoint format "gptq" (v1) stores each zero point minus one (AutoGPTQ's
convention: its dequantization adds the one back, so a zero of 0 wraps to 16); "gptq_v2"
(GPTQModel's) stores them as they are.

Served: 4 bits, symmetric or not, any group (a multiple of 8 or per channel), act-order or
not (desc_act: unpacked with the inputs sorted by group, Int4Levels.perm; served with the
activations gathered into that order, act_order.py). Refused,
naming the field: other bit widths, other checkpoint formats (marlin, bitblas...), and
`dynamic` overrides that change the bit width or group of some modules."""

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

SERVED = "bits 4, checkpoint_format gptq or gptq_v2"
WEIGHT = "qweight"  # the tensor that marks a GPTQ module (its .weight's place)
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True, slots=True)
class GptqScheme:
    group: int  # -1: per channel
    v2: bool  # zero points stored as they are (else minus one)
    desc_act: bool


def scheme(qc: dict) -> GptqScheme:
    require(qc, "bits", (4,), SERVED)
    fmt = require(qc, "checkpoint_format", ("gptq", "gptq_v2"), SERVED, default="gptq")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise UnservedVariant("quantization_config.group_size", group, "-1 or a multiple of 8")
    for pattern, override in (qc.get("dynamic") or {}).items():
        # "-:pattern": modules left unquantized (their 16-bit weights are in the checkpoint)
        if pattern.startswith("-:") or not override:
            continue
        for key, same in (("bits", 4), ("group_size", group)):
            if override.get(key, same) != same:
                raise UnservedVariant(
                    f"quantization_config.dynamic[{pattern!r}].{key}", override[key], SERVED
                )
    return GptqScheme(group, fmt == "gptq_v2", bool(qc.get("desc_act", False)))


def unpack(tensors: dict[str, torch.Tensor], s: GptqScheme, name: str) -> Int4Levels:
    """One module's tensors (by PARTS name) -> Int4Levels; `name` (the module's) for errors."""
    for part in ("qweight", "qzeros", "scales"):
        if part not in tensors:
            raise ValueError(f"GPTQ module {name!r} has no {part}")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{name}: GPTQ qweight and qzeros must be int32 matrices")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(
            f"{name}: GPTQ scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not "
            f"fit qweight {tuple(qweight.shape)} (expected [G, {n}] / [G, {n // 8}])"
        )
    group = k if groups == 1 else -(-k // groups)
    # qweight [K/8, N]: word (i, n) holds inputs 8i..8i+7 of output n
    levels = unpack_nibbles(qweight.t().contiguous())  # [N, K]
    zeros = unpack_nibbles(qzeros).to(torch.int16)  # [G, N]
    if not s.v2:
        zeros = zeros + 1
    perm = None
    if "g_idx" in tensors:
        perm = group_order(tensors["g_idx"], k, group, f"{name}.g_idx")
    if perm is not None:
        levels = levels[:, perm]
    return Int4Levels(
        levels.contiguous(),
        scales.float().t().contiguous(),
        symmetric_or_zeros(zeros.t().contiguous()),
        group,
        perm,
    )
