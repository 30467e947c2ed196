"""With batch invariance on (a speculating engine's), decode-sized products round each row as
it rounds alone (up to cpu.INVARIANT_ROWS rows): the k + 1 rows a speculating sequence
verifies give the bits its plain decode steps would, on every CPU path, for linear layers and
for the experts."""

from __future__ import annotations

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from inference.models.moe import select_experts
from tests.inference.test_cpu_kernels import path, randn  # noqa: F401 (the fixture)


@pytest.fixture
def invariant(path):  # noqa: F811
    cpu_kernels.batch_invariant(True)
    yield path
    cpu_kernels.batch_invariant(False)


def test_linear_rows_round_alike_in_any_decode_batch(invariant):
    # rows in groups of 4 (bf16) or 2 (float32) tiles and what is left over; input pairs past a
    # multiple of 4 (K 70, 66: the chains' tail); a narrow last column block (n 40, 20)
    for rows, k, n in [(5, 576, 192), (16, 96, 64), (3, 64, 40), (7, 70, 48), (6, 66, 20)]:
        w, x = cpu_kernels.pack_weight(randn(n, k, seed=1)), randn(rows, k, seed=2)
        batch = cpu_kernels.linear(x, w)
        for r in range(rows):
            assert torch.equal(cpu_kernels.linear(x[r : r + 1], w)[0], batch[r]), (rows, r)


def test_expert_rows_round_alike_in_any_decode_batch(invariant):
    e, d, i, t = 4, 64, 96, 5
    w13, w2 = (
        cpu_kernels.pack_weight(randn(e, 2 * i, d, scale=0.1)),
        cpu_kernels.pack_weight(randn(e, d, i, scale=0.1, seed=1)),
    )
    x = randn(t, d, seed=2)
    g = torch.Generator().manual_seed(t)
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), 2, True)
    batch, _ = cpu_kernels.moe(x, w13, w2, ids, weights)
    for r in range(t):
        alone, _ = cpu_kernels.moe(x[r : r + 1], w13, w2, ids[r : r + 1], weights[r : r + 1])
        assert torch.equal(alone[0], batch[r]), r
