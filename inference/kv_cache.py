"""The paged KV tensors, slot = block * block_size + offset. Per layer, one tensor per entry of
ModelArgs.kv_cache_shapes: a key and a value cache [slots, kv_heads, head_dim], or for MLA a
single latent cache [slots, 1, kv_lora_rank + qk_rope_head_dim]. Sized by kv_cache_tokens on
CPU and from free memory on GPU."""

from __future__ import annotations

import torch

from inference.config import ModelArgs


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return args.num_layers * sum(heads * width for heads, width in args.kv_cache_shapes) * elem


def num_cache_blocks(
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
) -> int:
    if kv_cache_tokens is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total  # keep headroom for activations
        kv_cache_tokens = max(int(budget // kv_bytes_per_token(args, dtype)), block_size)
    elif kv_cache_tokens is None:
        kv_cache_tokens = 65536
    return max(kv_cache_tokens // block_size, 1)


def allocate_kv_cache(
    args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    slots = num_blocks * block_size
    return [
        tuple(
            torch.zeros(slots, *shape, dtype=dtype, device=device) for shape in args.kv_cache_shapes
        )
        for _ in range(args.num_layers)
    ]
