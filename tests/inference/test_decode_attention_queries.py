"""The decode-attention kernel with several queries per sequence (speculative verification: a
sequence's last token and its k drafts, k + 1 consecutive positions sharing its block table,
each causal up to its own position), on every CPU path and in every KV-cache format, against
torch's causal attention; and each row's result bit for bit the one it gets alone, whatever
else is in the batch (so verified positions round exactly as plain decode steps do)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache as kv_cache
from tests.inference.test_cpu_kernels import (  # noqa: F401 (the fixture)
    close_to_bf16,
    close_to_int4_attention,
    path,
    randn,
)

# int4 joins once the cache has it (its own issue, landing beside this one)
FORMATS = ["bf16", "int8", "fp8_e4m3", "fp8_e5m2"] + (["int4"] if hasattr(kv_cache, "INT4") else [])


def filled_caches(fmt: str, slots: int, heads: int, width: int):
    """Key and value caches in `fmt`, every slot written, and both as float32 rows as torch
    reads them back."""
    k, v = randn(slots, heads, width, seed=7), randn(slots, heads, width, seed=8)
    if fmt == "bf16":
        return k, v, k.float(), v.float()
    storage = kv_cache.storage_dtype(fmt, torch.bfloat16)
    shape = (slots, heads, kv_cache.row_width(width, storage))
    kc, vc = torch.empty(shape, dtype=storage), torch.empty(shape, dtype=storage)  # all written
    every = torch.arange(slots)
    kv_cache.write_kv(kc, every, k)
    kv_cache.write_kv(vc, every, v)
    return kc, vc, kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)


def causal_reference(q, k_rows, v_rows, table, end, block_size, scale, window=0):
    """q [n, H, d]: queries at positions end - n .. end - 1 of one sequence, each over the
    positions up to its own (the last `window` of them where window > 0) -> [n, H, d]."""
    n, h = q.shape[0], q.shape[1]
    pos = torch.arange(end)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    g = k_rows.shape[1]
    k = k_rows[slots].float().repeat_interleave(h // g, 1).transpose(0, 1)  # [H, end, d]
    v = v_rows[slots].float().repeat_interleave(h // g, 1).transpose(0, 1)
    at = torch.arange(end - n, end).unsqueeze(1)  # each query's own position
    allowed = pos.unsqueeze(0) <= at
    if window:
        allowed &= pos.unsqueeze(0) > at - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def verify_rows(ends: list[int], q_lens: list[int], tables: torch.Tensor):
    """Rows of a verification step: sequence i brings q_lens[i] queries ending at ends[i], each
    row its sequence's block table and its own context length."""
    seq = torch.repeat_interleave(torch.arange(len(ends)), torch.tensor(q_lens))
    lens = [e - n + j + 1 for e, n in zip(ends, q_lens) for j in range(n)]
    return tables[seq].contiguous(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,ends,q_lens,window",
    [
        (8, 2, 64, [40, 170, 7], [5, 3, 1], 0),  # grouped heads, a plain decode row beside
        (8, 2, 64, [1000], [5], 0),  # one long sequence: split over the threads
        (4, 4, 64, [90, 33], [4, 2], 16),  # a sliding window: each query its own last 16
    ],
)
def test_several_queries_per_sequence_attend_causally(
    path,  # noqa: F811
    fmt,
    heads,
    kv_heads,
    dim,
    ends,
    q_lens,
    window,
):
    bs, nblocks = 16, 80
    kc, vc, kf, vf = filled_caches(fmt, nblocks * bs, kv_heads, dim)
    g = torch.Generator().manual_seed(2)
    width = max(ends) // bs + 1
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:width] for _ in ends]).int()
    row_tables, lens = verify_rows(ends, q_lens, tables)
    q = randn(int(lens.numel()), heads, dim, seed=3)
    out = cpu_kernels.decode_attention(q, kc, vc, row_tables, lens, bs, 0.125, window=window)
    first = 0
    for i, (end, n) in enumerate(zip(ends, q_lens)):
        rows = slice(first, first + n)
        expected = causal_reference(q[rows], kf, vf, tables[i], end, bs, 0.125, window)
        if fmt == "int4":
            close_to_int4_attention(out[rows], expected)
        else:
            close_to_bf16(out[rows], expected)
        first += n
    # each row alone: the same bits (its splits follow its own length, not the batch's)
    for r in range(q.shape[0]):
        alone = cpu_kernels.decode_attention(
            q[r : r + 1], kc, vc, row_tables[r : r + 1], lens[r : r + 1], bs, 0.125, window=window
        )
        assert torch.equal(alone[0], out[r]), f"row {r}"


def test_a_row_rounds_alike_in_any_batch_on_long_contexts(path):  # noqa: F811
    """Rows long enough to take their most splits (on 2 threads; fewer threads: more work each):
    alone, beside its own drafts and beside other rows, the same bits."""
    bs, nblocks, heads, kv_heads, dim = 16, 80, 8, 2, 64
    kc, vc, _, _ = filled_caches("bf16", nblocks * bs, kv_heads, dim)
    table = torch.randperm(nblocks, generator=torch.Generator().manual_seed(4))[:64].int()
    q = randn(8, heads, dim, seed=5)
    lens = torch.tensor([600 + 53 * i for i in range(8)], dtype=torch.int32)
    tables = table.expand(8, -1).contiguous()
    every = cpu_kernels.decode_attention(q, kc, vc, tables, lens, bs, 0.125)
    five = cpu_kernels.decode_attention(q[:5], kc, vc, tables[:5], lens[:5], bs, 0.125)
    alone = cpu_kernels.decode_attention(q[:1], kc, vc, tables[:1], lens[:1], bs, 0.125)
    assert torch.equal(every[:5], five) and torch.equal(five[:1], alone)
