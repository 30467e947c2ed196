"""gpt-oss's MXFP4 tensors as OpenAI publishes them (quant_method "mxfp4"): NAME_blocks uint8
[..., N, K/32, 16] (two e2m1 codes a byte, the low nibble first) and NAME_scales uint8 [...,
N, K/32] (e8m0: a power of two biased by 127), one scale per block of 32 inputs. Checked
here, naming the tensor; qweight.mxfp4_from_blocks makes the served weight of them and
dequantizes them as transformers' convert_moe_packed_tensors does."""

from __future__ import annotations

import torch

from inference.quantization import qweight as quant
from inference.quantization.qweight import QWeight

BLOCKS, SCALES = "_blocks", "_scales"


def scales_name(blocks_name: str) -> str:
    return blocks_name.removesuffix(BLOCKS) + SCALES


def blocks_name(scales_name: str) -> str:
    return scales_name.removesuffix(SCALES) + BLOCKS


def check(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Refuses tensors that are not MXFP4 as published, naming them."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16:
        raise ValueError(
            f"{name}: MXFP4 blocks must be uint8 [..., K/32, 16], got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{scales_name(name)}: MXFP4 scales must be uint8 of shape "
            f"{tuple(blocks.shape[:-1])} (one per block of 32 in {name}), got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )


def weight(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> QWeight:
    """The served mxfp4 weight, row-major [..., N, K] (N: the tensor's rows as published)."""
    check(name, blocks, scales)
    try:
        return quant.mxfp4_from_blocks(blocks, scales)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
