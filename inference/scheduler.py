"""Iteration-level (continuous) batching with chunked prefill and preemption by recompute.

No prefill or decode phases (vLLM v1): every sequence has num_computed_tokens and
num_tokens, and each step hands out tokens under a budget. Running sequences go first, in
arrival order; when the cache is full the most recently admitted one is preempted (its
blocks freed, its tokens recomputed later) so older requests always make progress. Waiting
sequences are admitted round-robin across their tenants (inference/waiting_queue.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from inference.block_manager import BlockManager
from inference.sequence import Sequence, SequenceStatus
from inference.waiting_queue import WaitingQueue

log = structlog.get_logger("inference.engine")  # the engine's lines: one logger for them


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    num_preempted: int = 0
    # vLLM's prefix-cache stats of the sequences admitted this step: tokens looked up in the
    # prefix cache, and those found there (a resumed preempted sequence counts in neither)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt=None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """on_preempt(seq): told of each preemption (default: a log line).
        long_prefill_token_threshold: a prompt's tokens per step, at most (0: no cap)."""
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.on_preempt = on_preempt or self._log_preemption

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # a decoding sequence's drafts (speculative decoding) ride after its last token,
            # as many as the budget leaves room for
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            n = min(n + len(seq.spec_token_ids), budget)
            del seq.spec_token_ids[max(n - 1, 0) :]
            while not self.bm.can_allocate(seq, n):
                if seq.spec_token_ids:  # drafts are given up before anyone is preempted
                    n -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq, n)
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        if out.num_preempted:  # no room to spare: admit nobody new this step
            return out
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            looked_up = not seq.block_table and not seq.needs_prompt_logprobs
            if looked_up:
                cached = self.bm.use_cached_prefix(seq)
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = cached
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.can_allocate(seq, n):
                self.bm.free_sequence(seq)  # don't sit on prefix blocks while waiting
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            # counted at admission, as vLLM does: a lookup that found no room is redone later
            if looked_up and self.bm.enable_prefix_caching and not seq.times.num_preemptions:
                out.prefix_cache_queries += seq.num_tokens
                out.prefix_cache_hits += seq.num_computed_tokens
            self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        """A sequence's new tokens this step: its remaining ones, within the budget and (a
        prompt's) the long-prefill cap."""
        cap = self.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap > 0 else min(remaining, budget)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence wherever it is (running, waiting) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
        self.bm.free_sequence(seq)

    def _log_preemption(self, seq: Sequence) -> None:
        log.info(
            "sequence preempted",
            seq_id=seq.seq_id,
            num_tokens=seq.num_tokens,
            kv_usage=round(self.bm.usage, 3),
            **seq.log_context,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.times.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.on_preempt(seq)
