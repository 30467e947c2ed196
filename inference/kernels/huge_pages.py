"""CPU tensors in 2 MB pages (Linux's transparent huge pages) for what the kernels stream from
memory at every step: the packed weights and the KV cache.

In 4 KB pages a decode step that streams hundreds of MB of weights needs a new translation
every 4 KB, far past what the TLBs hold (a few MB), so it walks the page tables as it goes. Most
systems run THP in `madvise` mode, where only memory asked for with MADV_HUGEPAGE gets huge
pages, and torch asks for none (its THP_MEM_ALLOC_ENABLE would, for every allocation of 2 MB
or more, activations too, each then paying the kernel's compaction at its first touch). So
these tensors live in an anonymous private mapping of their own, advised before its first
touch, where it faults in 2 MB at a time. Elsewhere (no madvise, small tensors) they are plain
tensors: pages change the speed, never the values.
"""

from __future__ import annotations

import math
import mmap

import torch

PAGE = 2 << 20  # a huge page (x86-64, arm64 with 4 KB base pages)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose whole 2 MB pages are advised huge (fresh anonymous memory comes
    zeroed, and is touched only as it is written); under one page, or where the system cannot
    advise, torch.zeros."""
    t = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if t is None else t


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """t (a CPU tensor, any strides) contiguous in huge pages; t.contiguous() where zeros()
    would not map it."""
    out = _mapped(t.shape, t.dtype)
    if out is None:
        return t.contiguous()
    out.copy_(t)
    return out


def _mapped(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # private: THP serves anonymous private memory (a shared mapping is shmem, its own setting)
    region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -raw.data_ptr() % PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // PAGE * PAGE)
    except OSError:  # THP off in this kernel: the mapping serves in small pages
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)
