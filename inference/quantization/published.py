"""What the 4-bit formats people publish (GPTQ, AWQ, compressed-tensors pack-quantized) come
to once unpacked: integer levels in [0, 15], a scale and an integer zero point per output
channel and group of inputs, w = (level - zero) * scale. Each format's module (gptq.py,
awq.py, compressed_tensors.py) reads its config and unpacks its tensors into Int4Levels;
qweight.int4_from_levels makes the served weight of them.

A variant we do not serve is refused at start-up naming the config field that says so
(UnservedVariant)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnservedVariant(ValueError):
    """A checkpoint's quantization_config asks for a variant we do not serve; `field` names
    the config field (e.g. "quantization_config.bits")."""

    def __init__(self, field: str, value, served: str) -> None:
        super().__init__(f"{field} = {value!r} is not served here (served: {served})")
        self.field = field


def require(qc: dict, key: str, allowed: tuple, served: str, default=None, where: str = ""):
    """qc[key] (or `default` where absent), refused unless in `allowed`."""
    value = qc.get(key, default)
    if value not in allowed:
        raise UnservedVariant(f"quantization_config.{where}{key}", value, served)
    return value


@dataclass(eq=False)
class Int4Levels:
    """One quantized matrix unpacked. `levels` are in the order that makes the groups
    contiguous: input `perm[j]` of the checkpoint is column j (act-order checkpoints; perm is
    None where the checkpoint's order already is)."""

    levels: torch.Tensor  # uint8 [N, K] in [0, 15]
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor | None  # int16 [N, G] (GPTQ v1's may reach 16); None: every zero 8
    group: int  # inputs per group (K: per channel)
    perm: torch.Tensor | None = None  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """w [N, K] float32 in the checkpoint's input order."""
        k = self.levels.shape[-1]
        zeros = 8.0 if self.zeros is None else per_input(self.zeros.float(), self.group, k)
        w = (self.levels.float() - zeros) * per_input(self.scales, self.group, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def per_input(grouped: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[N, G] -> [N, k]: each input its group's value."""
    return grouped.repeat_interleave(group, dim=-1)[..., :k]


def symmetric_or_zeros(zeros: torch.Tensor) -> torch.Tensor | None:
    """None where every zero point is 8 (symmetric: the kernels skip the zero-point term)."""
    return None if bool((zeros == 8).all()) else zeros


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8 W]: word w's 4-bit fields, the lowest bits first (the
    order GPTQ, AWQ before its interleave, and compressed-tensors pack in)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return fields.to(torch.uint8).flatten(-2)


def group_order(g_idx: torch.Tensor, k: int, group: int, field: str) -> torch.Tensor | None:
    """An act-order checkpoint's g_idx [K] (input k belongs to group g_idx[k]) -> the input
    order that makes each group `group` contiguous inputs, or None where the checkpoint's
    order already does (g_idx[k] = k // group: no act-order, or a sorted one)."""
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise ValueError(f"{field} has shape {tuple(g_idx.shape)}, expected ({k},)")
    contiguous = torch.arange(k) // group
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"{field}: its groups are not {group} inputs each")
    return perm
