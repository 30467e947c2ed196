"""Verification of draft tokens against the target model's logits at k + 1 positions
(vLLM's RejectionSampler for drafts with a one-hot draft distribution, as n-gram drafts are).

Greedy: a draft is accepted while it is the target's top token; the first mismatch is replaced
by the top token, so the output is the one non-speculative greedy decoding gives. Sampling:
draft d at a position is accepted with probability p(d) (p: the target's distribution after
temperature and truncation, as the sampler draws from it); on rejection the token is drawn
from p with d removed, renormalised; with every draft accepted a bonus token is drawn from
the last position's p. Each emitted token is then distributed exactly as p (Leviathan et
al. 2023 with q one-hot).
"""

from __future__ import annotations

import torch

from inference.executor.sampler import Sampler
from inference.sequence import Sequence


def _ban_stop_tokens(sampler: Sampler, logits: torch.Tensor, drafts) -> None:
    """min_tokens: a position whose token would still be under the minimum cannot stop (as
    the sampler does for a single row)."""
    row = 0
    for seq, draft in drafts:
        p = seq.params
        stop_ids = [t for t in sampler.eos_token_ids + p.stop_token_ids if t < logits.shape[1]]
        for j in range(len(draft) + 1):
            if seq.num_output_tokens + j < p.min_tokens:
                logits[row + j, stop_ids] = float("-inf")
        row += len(draft) + 1


def verify(
    sampler: Sampler, logits: torch.Tensor, drafts: list[tuple[Sequence, list[int]]]
) -> list[list[int]]:
    """`logits`: [sum(len(draft) + 1), V], each sequence's rows in order (the row before its
    first draft, then one per draft). Returns each sequence's new tokens: its accepted drafts
    and one more (the replacement of the first rejected draft, or the bonus token)."""
    params = [seq.params for seq, draft in drafts for _ in range(len(draft) + 1)]
    greedy = [p.greedy for p in params]
    needs_ban = any(seq.num_output_tokens < seq.params.min_tokens for seq, _ in drafts)
    floats = logits.float()
    if needs_ban:
        floats = floats.clone() if floats is logits else floats
        _ban_stop_tokens(sampler, floats, drafts)
    top: list[int] = []
    if any(greedy):  # the same top token the sampler's greedy path picks
        top = floats.argmax(dim=-1).tolist() if needs_ban else sampler.greedy(logits)
    probs = None
    if not all(greedy):
        probs = sampler.probs(floats, params, greedy)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    out: list[list[int]] = []
    row = 0
    for seq, draft in drafts:
        k = len(draft)
        if seq.params.greedy:
            accepted = 0
            while accepted < k and draft[accepted] == top[row + accepted]:
                accepted += 1
            out.append(draft[:accepted] + [top[row + accepted]])
        else:
            out.append(_accept_sampled(probs[row : row + k + 1], draft))
        row += k + 1
    return out


def _accept_sampled(p: torch.Tensor, draft: list[int]) -> list[int]:
    """p: [k + 1, V] normalised target distributions."""
    k = len(draft)
    ids = torch.tensor(draft, device=p.device)
    p_draft = p[torch.arange(k, device=p.device), ids]
    rejected = (torch.rand(k, device=p.device) >= p_draft).nonzero()
    if not len(rejected):  # every draft accepted: the bonus token from the last position
        return draft + [int(torch.multinomial(p[k], 1))]
    at = int(rejected[0])
    residual = p[at].clone()
    residual[draft[at]] = 0.0  # max(p - q, 0) with q one-hot at the draft
    if not residual.sum() > 0:  # p(d) was 1 but for rounding: nothing else to draw
        return draft[: at + 1]
    return draft[:at] + [int(torch.multinomial(residual, 1))]
