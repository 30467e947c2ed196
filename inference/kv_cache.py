"""The paged KV tensors: per layer a key and a value cache of shape [slots, kv_heads, head_dim],
slot = block * block_size + offset. Sized by kv_cache_tokens on CPU and from free memory on GPU."""

from __future__ import annotations

import torch

from inference.config import ModelArgs


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * elem


def num_cache_blocks(args: ModelArgs, dtype: torch.dtype, device: torch.device, block_size: int,
                     kv_cache_tokens: int | None, gpu_memory_utilization: float) -> int:
    if kv_cache_tokens is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total  # keep headroom for activations
        kv_cache_tokens = max(int(budget // kv_bytes_per_token(args, dtype)), block_size)
    elif kv_cache_tokens is None:
        kv_cache_tokens = 65536
    return max(kv_cache_tokens // block_size, 1)


def allocate_kv_cache(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks * block_size, args.num_kv_heads, args.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(args.num_layers)]
