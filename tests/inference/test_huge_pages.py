"""Packed weights and the KV cache in 2 MB pages (inference/kernels/huge_pages.py): the same
values, whole huge pages where the system's THP allows them, plain tensors below a page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from inference.executor.kv_cache import allocate_kv_cache
from inference.kernels import huge_pages
from inference.models.args import ModelArgs
from inference.models.paged_cache import INT4

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping that holds t's first byte (/proc/self/smaps)."""
    address, found = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            found = int(span[1], 16) <= address < int(span[2], 16)
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def thp_allowed() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def test_zeros_come_zeroed_and_page_aligned():
    t = huge_pages.zeros((3, huge_pages.PAGE // 2), torch.float32)  # 6 pages' worth
    assert t.shape == (3, huge_pages.PAGE // 2) and t.dtype == torch.float32
    assert t.is_contiguous() and t.data_ptr() % huge_pages.PAGE == 0
    assert not t.any()


@pytest.mark.skipif(not thp_allowed(), reason="transparent huge pages are off here")
def test_written_pages_are_huge():
    t = huge_pages.zeros((4 * huge_pages.PAGE,), torch.uint8)
    t.fill_(7)  # first touch: faults in 2 MB at a time
    assert huge_kb(t) >= huge_pages.PAGE // 1024
    assert int(t.sum()) == 7 * t.numel()


def test_copy_keeps_the_values():
    src = torch.randn(5, huge_pages.PAGE // 2 + 3).bfloat16()  # a partial last page
    out = huge_pages.copy_of(src)
    assert out.data_ptr() != src.data_ptr() and out.data_ptr() % huge_pages.PAGE == 0
    assert out.dtype == src.dtype and out.shape == src.shape and torch.equal(out, src)
    out.add_(1)  # its own memory
    assert not torch.equal(out, src)


def test_below_a_page_stays_plain():
    small = torch.arange(1000, dtype=torch.int32)
    assert huge_pages.copy_of(small) is small
    z = huge_pages.zeros((10, 10), torch.float32)
    assert not z.any() and z.shape == (10, 10)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8, INT4])
def test_kv_cache_zeroed_in_huge_pages(storage):
    args = ModelArgs(
        architecture="MixtralForCausalLM",
        vocab_size=32,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    caches = allocate_kv_cache(args, 2048, 16, storage, torch.device("cpu"))
    assert len(caches) == 2
    for layer in caches:
        for t in layer:
            assert t.dtype == storage and t.data_ptr() % huge_pages.PAGE == 0
            assert not t.view(torch.uint8).any()
