"""AWQ checkpoints in AutoAWQ's GEMM packing (quant_method "awq", version "gemm"), as AutoAWQ,
AutoRound and llm-compressor's AWQ export write them: per module `qweight` int32 [K, N/8]
(eight 4-bit levels a word along the outputs, interleaved: the word's fields hold columns
0, 2, 4, 6, 1, 3, 5, 7 of its eight), `qzeros` int32 [G, N/8] packed the same way and
`scales` fp16 [G, N]. w = (level - zero) * scale, groups contiguous (AWQ has no act-order).

Served: 4 bits, GEMM packing, any group (a multiple of 8 or per channel), with zero points
or without (zero_point false: every zero 8, where the checkpoint carries no qzeros).
Refused, naming the field: other bit widths and the other packings (gemv, gemv_fast,
marlin, exllama, ipex)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.quantization.published import (
    Int4Levels,
    UnservedVariant,
    require,
    symmetric_or_zeros,
    unpack_nibbles,
)

SERVED = "bits 4, version gemm"
WEIGHT = "qweight"
PARTS = ("qweight", "qzeros", "scales")
# the word's field i holds column _FIELD_COLUMN[i] of its eight (AutoAWQ's AWQ_ORDER)
_FIELD_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True, slots=True)
class AwqScheme:
    group: int  # -1: per channel
    zero_point: bool


def scheme(qc: dict) -> AwqScheme:
    require(qc, "bits", (4,), SERVED, default=qc.get("w_bit"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnservedVariant("quantization_config.version", qc.get("version"), SERVED)
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise UnservedVariant("quantization_config.group_size", group, "-1 or a multiple of 8")
    return AwqScheme(group, bool(qc.get("zero_point", True)))


def _columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's interleaved packing -> uint8 [R, N] in column order."""
    fields = unpack_nibbles(words).unflatten(-1, (-1, 8))  # [R, N/8, 8]: field order
    columns = torch.empty_like(fields)
    columns[..., list(_FIELD_COLUMN)] = fields
    return columns.flatten(-2)


def unpack(tensors: dict[str, torch.Tensor], s: AwqScheme, name: str) -> Int4Levels:
    for part in ("qweight", "scales"):
        if part not in tensors:
            raise ValueError(f"AWQ module {name!r} has no {part}")
    qweight, scales = tensors["qweight"], tensors["scales"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{name}: AWQ qweight must be an int32 matrix")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"{name}: AWQ scales {tuple(scales.shape)}, expected [G, {n}]")
    levels = _columns(qweight).t().contiguous()  # [N, K]
    qzeros = tensors.get("qzeros")
    if qzeros is None:
        if s.zero_point:
            raise ValueError(f"AWQ module {name!r} has no qzeros (zero_point is true)")
        zeros = None
    else:
        if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // 8):
            raise ValueError(f"{name}: AWQ qzeros {tuple(qzeros.shape)}, expected [G, {n // 8}]")
        zeros = symmetric_or_zeros(_columns(qzeros).to(torch.int16).t().contiguous())
    group = k if groups == 1 else -(-k // groups)
    return Int4Levels(levels, scales.float().t().contiguous(), zeros, group)
