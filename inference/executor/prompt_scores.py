"""Prompt scoring (SamplingParams.prompt_logprobs) of a chunk's hidden rows: each row's logits
predict the next prompt token, whose log-softmax, rank and the top-k alternatives are asked.

A prefill computes the logits of one row; scoring needs every row's over the whole
vocabulary, so the lm_head runs at every position. What is avoided is everything else a
[rows, vocab] float32 log-softmax costs (its copies, a comparison tensor, a top-k over it):
on the CPU kernels the lm_head and the scoring run a tile of rows at a time in C
(kernels/csrc/logits.c: one bf16 tile of logits in its scratch, no tensor of torch's);
other logits on the CPU are scored by the same C passes; elsewhere (a GPU, kernels off) torch
scores pieces of rows through a logsumexp instead of a full log-softmax. Scoring then costs
the lm_head's products on every row and little else (bench/scoring_bench.py's floor).
"""

from __future__ import annotations

import torch
from torch import nn

from inference.kernels import cpu
from inference.kernels.modules import CpuLinear
from inference.models.decoder import Decoder
from inference.outputs import TokenLogprob, TokenLogprobs

PIECE_ROWS = 256  # rows whose logits torch holds at once (the kernels tile on their own)


def score_rows(
    model: nn.Module, hidden: torch.Tensor, targets: list[int], top_n: int
) -> list[TokenLogprobs]:
    """hidden [len(targets), D]: row i's log-softmax at targets[i], its rank (vLLM's
    Logprob.rank: 1 + the tokens above it) and its top_n tokens by logprob."""
    k = min(max(top_n, 0), model.args.vocab_size)
    if not targets:
        return []
    ids = torch.tensor(targets, dtype=torch.int64)
    lm_head = getattr(model, "lm_head", None)
    if (
        isinstance(lm_head, CpuLinear)
        and type(model).logits is Decoder.logits  # the logits are the lm_head's, nothing more
        and cpu.applies(hidden)
    ):
        scores = cpu.logit_scores(hidden, lm_head.weight, lm_head.bias, ids, k)
    else:
        pieces = [
            _score_logits(model.logits(hidden[i : i + PIECE_ROWS]), ids[i : i + PIECE_ROWS], k)
            for i in range(0, len(targets), PIECE_ROWS)
        ]
        scores = tuple(torch.cat(parts) for parts in zip(*pieces))
    values, ranks, top_ids, top_values = (t.tolist() for t in scores)
    return [
        TokenLogprobs(token, value, [TokenLogprob(t, v) for t, v in zip(ti, tv)], rank)
        for token, value, rank, ti, tv in zip(targets, values, ranks, top_ids, top_values)
    ]


def _score_logits(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """(target logprobs, ranks, top-k ids, top-k logprobs) of logits [rows, vocab], on the CPU
    (float32 results)."""
    if cpu.ISA is not None and logits.is_cpu and logits.dtype in (torch.bfloat16, torch.float32):
        return cpu.logprob_rows(logits, targets, k)
    logits = logits.float()
    targets = targets.to(logits.device).unsqueeze(1)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(1, targets)
    ranks = (logits > chosen).sum(dim=-1) + 1
    top_values, top_ids = logits.topk(k, dim=-1)
    return tuple(t.cpu() for t in ((chosen - lse)[:, 0], ranks, top_ids, top_values - lse))
