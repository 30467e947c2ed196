"""The decode-attention kernel's ways through a chunk of context (csrc/attention.c), each
against torch's attention on every CPU path: the query heads of a kv head taken up to four at
a time (every count of them, and more than four), on vdpbf16ps straight from bf16 rows (the
avx512bf16 build, dims a multiple of 32), on float32 FMAs reading bf16 rows or quantized
rows widened (every build; the fallback where the dims are not), and one head at a time where
the dims are not whole vectors; contexts ending inside and at the edges of the kernel's
chunks of 32 positions and groups of 4."""

from __future__ import annotations

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from tests.inference.test_cpu_kernels import (  # noqa: F401 (the fixture)
    close_to_bf16,
    close_to_int4_attention,
    path,
    randn,
)
from tests.inference.test_decode_attention_queries import causal_reference, filled_caches

LENGTHS = [1, 3, 4, 31, 32, 33, 67, 300]


@pytest.mark.parametrize(
    "heads,kv_heads,dim,fmt",
    [
        (8, 2, 64, "bf16"),  # four query heads a kv head (the demo MoE)
        (9, 3, 64, "bf16"),  # three (SmolLM2)
        (6, 3, 32, "bf16"),  # two, the narrowest bf16-pair rows
        (2, 2, 64, "bf16"),  # one (no grouping)
        (10, 2, 128, "bf16"),  # five: a block of four, then one
        (4, 2, 48, "bf16"),  # not whole bf16-pair vectors: float32 FMAs in every build
        (4, 1, 40, "bf16"),  # not whole AVX-512 vectors: one head at a time there
        (8, 2, 64, "int8"),  # quantized rows: widened, then the heads together
        (9, 3, 64, "int4"),
    ],
)
def test_every_grouping_of_heads_and_chunk_edge_matches_torch(
    path,  # noqa: F811
    heads,
    kv_heads,
    dim,
    fmt,
):
    bs, nblocks = 16, 40
    kc, vc, kf, vf = filled_caches(fmt, nblocks * bs, kv_heads, dim)
    g = torch.Generator().manual_seed(11)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:20] for _ in LENGTHS]).int()
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    q = randn(len(LENGTHS), heads, dim, seed=12)
    scale = dim**-0.5
    out = cpu_kernels.decode_attention(q, kc, vc, tables, lens, bs, scale)
    for r, end in enumerate(LENGTHS):
        expected = causal_reference(q[r : r + 1], kf, vf, tables[r], end, bs, scale)
        if fmt == "int4":
            close_to_int4_attention(out[r : r + 1], expected)
        else:
            close_to_bf16(out[r : r + 1], expected)
