"""Prompt scoring's C passes (csrc/logits.c, cpu.logprob_rows and cpu.logit_scores) on every
kernel path this CPU runs, forced one by one: each row's log-softmax at its target, its rank
and its top k against torch's float32 log-softmax of the same logits, ties, k of 0 and of the
whole vocabulary, strided and masked rows, the lm_head's own logits (bf16 and int8 weights)
scored a tile of rows at a time, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from inference.quantization import qweight as quant
from tests.inference.kernel_paths import PATHS, forced


@pytest.fixture(params=PATHS, ids=str)
def path(request):
    with forced(request.param) as p:
        yield p


def logits_of(rows: int, vocab: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(dtype)


def check(scores, logits: torch.Tensor, targets: torch.Tensor, k: int, atol: float = 1e-5):
    """scores = (target logprobs, ranks, top ids, top logprobs) of logits, as torch has them:
    ranks exactly (1 + the logits strictly above the target's), top ids those of the top
    values (the lower id first on a tie)."""
    lp, ranks, top_ids, top_lp = scores
    x = logits.float()
    ref = x.log_softmax(-1)
    chosen = x.gather(1, targets.unsqueeze(1))
    torch.testing.assert_close(lp, ref.gather(1, targets.unsqueeze(1))[:, 0], rtol=0, atol=atol)
    assert torch.equal(ranks, (x > chosen).sum(-1) + 1)
    assert top_ids.shape == top_lp.shape == (x.shape[0], k)
    if k:
        # stable descending sort: ties keep the lower id first, as the kernel does
        values, order = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(top_ids, order[:, :k])
        torch.testing.assert_close(top_lp, ref.gather(1, top_ids), rtol=0, atol=atol)
        assert torch.equal(x.gather(1, top_ids), values[:, :k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, vocab", [(37, 32000), (5, 17), (3, 1001), (1, 151936)])
def test_rows_score_as_torchs_log_softmax(path, dtype, rows, vocab):
    logits = logits_of(rows, vocab, dtype, seed=rows)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
    for k in (0, 1, 5):
        check(cpu_kernels.logprob_rows(logits, targets, k), logits, targets, k)


def test_ties_masked_logits_strided_rows_and_the_whole_vocabulary(path):
    logits = logits_of(4, 300, torch.bfloat16)
    logits[0, [40, 7, 250]] = 20.0  # tied maxima: ids 7, 40, 250 in that order
    logits[1, :] = 1.0  # all tied: the target ranks first, the top is ids 0, 1, 2...
    logits[2, 100:] = -float("inf")  # masked tokens (a grammar's): never above the target
    targets = torch.tensor([40, 9, 3, 299])
    scores = cpu_kernels.logprob_rows(logits, targets, 3)
    check(scores, logits, targets, 3)
    assert scores[2][0].tolist() == [7, 40, 250] and scores[1][:2].tolist() == [1, 1]
    assert scores[2][1].tolist() == [0, 1, 2]
    check(cpu_kernels.logprob_rows(logits, targets, 300), logits, targets, 300)
    wide = logits_of(4, 320, torch.float32)
    check(cpu_kernels.logprob_rows(wide[:, :300], targets, 2), wide[:, :300], targets, 2)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 45, 300])
def test_the_lm_heads_logits_score_a_tile_at_a_time(path, fmt, rows):
    """ms_logit_scores runs the lm_head in tiles of rows and scores each: the same logits
    cpu.linear gives (the model's own), the same scores as scoring them whole."""
    vocab, hidden = 3001, 96  # a narrow last column block
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(vocab, hidden, generator=g) / 5
    weight = (
        cpu_kernels.pack_weight(w.bfloat16())
        if fmt == "bf16"
        else cpu_kernels.pack_qweight(quant.quantize_int8(w))
    )
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logits = cpu_kernels.linear(x, weight)
    for k, tile_rows in ((0, 0), (4, 0), (4, 64)):  # 64: tiles of 64 rows, the last partial
        scores = cpu_kernels.logit_scores(x, weight, None, targets, k, tile_rows)
        check(scores, logits, targets, k)


def test_a_target_outside_the_vocabulary_or_too_many_top_tokens_is_refused(path):
    logits = logits_of(2, 50, torch.bfloat16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cpu_kernels.logprob_rows(logits, torch.tensor([3, 50]), 1)
    with pytest.raises(ValueError, match="k larger"):
        cpu_kernels.logprob_rows(logits, torch.tensor([3, 4]), 51)
    weight = cpu_kernels.pack_weight(logits_of(50, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cpu_kernels.logit_scores(
            logits_of(2, 16, torch.bfloat16), weight, None, torch.tensor([-1, 0]), 1
        )
