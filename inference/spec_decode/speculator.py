"""Which sequences speculate each step, with how many draft tokens, and what their acceptance
teaches (k adapted per sequence).

Verifying k drafts costs a step k more positions (on an MoE, more distinct experts woken), so
k follows each sequence's recent acceptance: it grows by one after a draft accepted in full,
falls to one past what was accepted otherwise, and a sequence whose drafts keep failing stops
speculating for a while (longer each time). Past `disable_by_batch_size` running sequences a
step is compute-bound and nobody speculates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from inference.sequence import Sequence
from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.ngram import propose_ngram

MISSES_BEFORE_PAUSE = 3  # drafts in a row with nothing accepted
PAUSE_TOKENS = 16  # the first pause, in generated tokens; doubled each time, up to 16x
MAX_PAUSE_DOUBLINGS = 4


class DraftLength:
    """One sequence's draft length k, from its recent acceptance."""

    __slots__ = ("k", "k_max", "misses", "paused_until", "pauses")

    def __init__(self, k_max: int) -> None:
        self.k = self.k_max = k_max
        self.misses = self.pauses = 0
        self.paused_until = 0  # sequence length before which it does not speculate

    def current(self, num_tokens: int) -> int:
        return 0 if num_tokens < self.paused_until else self.k

    def record(self, drafted: int, accepted: int, num_tokens: int) -> None:
        if accepted == drafted:
            self.k = min(self.k + 1, self.k_max)
            self.misses = self.pauses = 0
        elif accepted:
            self.k = accepted + 1
            self.misses = 0
        else:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= MISSES_BEFORE_PAUSE:
                self.paused_until = num_tokens + (
                    PAUSE_TOKENS << min(self.pauses, MAX_PAUSE_DOUBLINGS)
                )
                self.pauses += 1
                self.misses = 0


def can_speculate(seq: Sequence) -> bool:
    """Requests whose next token depends on more than the logits at its position speculate not:
    grammars and logit_bias (a mask per position), penalties (counts that change with each
    accepted token), logprobs (not computed for verified positions), and seeded sampling (its
    draws would no longer follow its generator as without speculation). Greedy ones do, seeded
    or not."""
    p = seq.params
    return (
        seq.matcher is None
        and seq.reasoning_matcher is None
        and p.structured_outputs is None
        and not p.logit_bias
        and p.logprobs is None
        and not p.needs_penalties
        and (p.greedy or seq.generator is None)
    )


class Speculator(ABC):
    """Which sequences draft, how many tokens each; a method's subclass proposes them."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's spec_token_ids for the coming step (empty where it
        does not speculate)."""
        off = len(running) > self.config.disable_by_batch_size
        for seq in running:
            seq.spec_token_ids = [] if off else self._draft(seq)

    def _draft(self, seq: Sequence) -> list[int]:
        # only a decoding sequence (its one new token is the last sampled) speculates
        if seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
            return []
        if seq.draft_length is None:
            seq.draft_length = DraftLength(self.config.num_speculative_tokens)
        k = min(
            seq.draft_length.current(seq.num_tokens),
            # the bonus token is the last one max_tokens allows; no draft past the model's length
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens,
        )
        return self._propose(seq, k) if k >= 1 else []

    @abstractmethod
    def _propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens to follow the sequence's last (fewer, or none, allowed)."""

    @staticmethod
    def record(seq: Sequence, drafted: int, accepted: int) -> None:
        seq.draft_length.record(drafted, accepted, seq.num_tokens)
        seq.times.spec_draft_tokens += drafted
        seq.times.spec_accepted_tokens += accepted


class NgramSpeculator(Speculator):
    def _propose(self, seq: Sequence, k: int) -> list[int]:
        c = self.config
        return propose_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)
