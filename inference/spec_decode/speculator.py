"""Which sequences speculate each step, with how many draft tokens, and what their acceptance
teaches (k adapted per sequence).

Verifying k drafts costs a step k more rows (on an MoE, more distinct experts woken, and every
row's products), so each sequence's k is the one with the most expected tokens per unit of
step cost: its recent acceptance per drafted position (an exponentially weighted estimate)
gives the expected tokens of k drafts, and step_cost.StepCost what k more rows cost, measured
on the engine's own steps (vLLM RFC 46295's utility for MoE). A sequence whose drafts keep
failing stops speculating for a while (longer each time); one for which no k pays still
drafts one token, which verifies its acceptance estimate. Past
`disable_by_batch_size` running sequences a step is compute-bound and nobody speculates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from inference.sequence import Sequence
from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.ngram import propose_ngram
from inference.spec_decode.step_cost import StepCost

# drafts in a row with nothing accepted before a pause (replaying the demo MoE's and SmolLM2's
# greedy outputs, 3 paused the demo's repeat workload just before its drafts began to hold)
MISSES_BEFORE_PAUSE = 5
PAUSE_TOKENS = 16  # the first pause, in generated tokens; doubled each time, up to 16x
MAX_PAUSE_DOUBLINGS = 4
# a sequence's acceptance estimate: where it starts, and the weight of each verified position
# (0.5 follows the demo MoE's and SmolLM2's bursts of copied text: replaying their greedy
# outputs, it took more tokens per unit of cost than 0.15 or 0.3)
ACCEPTANCE_PRIOR = 0.8
ACCEPTANCE_WEIGHT = 0.5


class DraftLength:
    """One sequence's draft length k, from its recent acceptance and the cost of more rows."""

    __slots__ = ("acceptance", "cost", "k_max", "misses", "paused_until", "pauses")

    def __init__(self, k_max: int, cost: StepCost | None = None) -> None:
        self.k_max = k_max
        self.cost = StepCost() if cost is None else cost
        self.acceptance = ACCEPTANCE_PRIOR  # P(a drafted position is accepted | reached)
        self.misses = self.pauses = 0
        self.paused_until = 0  # sequence length before which it does not speculate

    def _best(self) -> int:
        """The k in [0, k_max] with the most expected tokens per unit of cost: a step of the
        batch's n rows gives n tokens; drafting k more gives n - 1 + (1 + a + ... + a^k)."""
        n, a = self.cost.batch, self.acceptance
        best, best_rate, expected, term = 0, 1.0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            term *= a
            expected += term
            rate = (n - 1 + expected) / (n * self.cost.ratio(n + k, n))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    @property
    def k(self) -> int:
        """The draft length now (at least one: a probe, where no k pays, until paused)."""
        return max(self._best(), 1)

    def current(self, num_tokens: int) -> int:
        return 0 if num_tokens < self.paused_until else self.k

    def record(self, drafted: int, accepted: int, num_tokens: int) -> None:
        a, w = self.acceptance, ACCEPTANCE_WEIGHT
        a = 1.0 - (1.0 - a) * (1.0 - w) ** accepted  # each accepted position
        if accepted < drafted:  # and the first rejected one (later ones were not reached)
            a *= 1.0 - w
        self.acceptance = a
        if accepted == drafted:
            self.pauses = 0
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.paused_until = num_tokens + (PAUSE_TOKENS << min(self.pauses, MAX_PAUSE_DOUBLINGS))
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
        self.cost = StepCost()  # the engine's decode steps by rows: what drafting k costs

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's spec_token_ids for the coming step (empty where it
        does not speculate)."""
        off = len(running) > self.config.disable_by_batch_size
        self.cost.batch = max(len(running), 1)
        for seq in running:
            seq.spec_token_ids = [] if off else self._draft(seq)

    def _draft(self, seq: Sequence) -> list[int]:
        # only a decoding sequence (its one new token is the last sampled) speculates
        if seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
            return []
        if seq.draft_length is None:
            seq.draft_length = DraftLength(self.config.num_speculative_tokens, self.cost)
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
