"""Sizing and allocating the paged KV tensors (their row formats: models/paged_cache.py). Sized
by kv_cache_tokens (or kv_cache_bytes) on CPU and from free memory on GPU."""

from __future__ import annotations

import torch

from inference.kernels import huge_pages
from inference.models.args import ModelArgs
from inference.models.paged_cache import INT4, INT4_GROUP, reads_alone, row_width


def kv_bytes_per_token(args: ModelArgs, storage: torch.dtype) -> int:
    elem = torch.empty((), dtype=storage).element_size()  # int4 (torch.uint4): a byte
    rows = sum(heads * row_width(width, storage) for heads, width in args.kv_cache_shapes)
    return (args.num_layers + args.mtp) * rows * elem  # the MTP layer's cache too


def num_cache_blocks(
    args: ModelArgs,
    storage: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    kv_cache_bytes: int | None = None,
) -> int:
    if kv_cache_bytes is not None:
        kv_cache_tokens = kv_cache_bytes // kv_bytes_per_token(args, storage)
    elif kv_cache_tokens is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total  # keep headroom for activations
        kv_cache_tokens = max(int(budget // kv_bytes_per_token(args, storage)), block_size)
    elif kv_cache_tokens is None:
        kv_cache_tokens = 65536
    return max(kv_cache_tokens // block_size, 1)


def allocate_kv_cache(
    args: ModelArgs, num_blocks: int, block_size: int, storage: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    r = args.kv_lora_rank
    if r and not reads_alone(r, r + args.qk_rope_head_dim, storage):
        # attention reads the latent's first r values back as its values
        whole = f" and of int4's groups of {INT4_GROUP}" if storage == INT4 else ""
        raise ValueError(
            f"a quantized KV cache cannot hold this model's MLA latent ({r} + "
            f"{args.qk_rope_head_dim} values per row: its {r} values are no whole rotation "
            f"blocks{whole}): use --kv-cache-dtype auto"
        )
    if storage == INT4 and any(width % 2 for _, width in args.kv_cache_shapes):
        raise ValueError(
            "an int4 KV cache holds two values a byte: this model's cache rows have an odd "
            f"width ({args.kv_cache_shapes}): use --kv-cache-dtype int8 or auto"
        )
    slots = num_blocks * block_size
    return [
        tuple(
            # torch fills no uint4 tensor (int4's marker dtype): zero bytes, viewed as it
            _zeros((slots, heads, row_width(width, storage)), _filled(storage), device).view(
                storage
            )
            for heads, width in args.kv_cache_shapes
        )
        for _ in range(args.num_layers + args.mtp)  # the last: the MTP layer's (ModelArgs.mtp)
    ]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor; on the CPU in huge pages (decode attention streams it)."""
    if device.type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _filled(storage: torch.dtype) -> torch.dtype:
    return torch.uint8 if storage == INT4 else storage
