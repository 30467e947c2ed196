"""One sequence being generated: its tokens, progress, cache blocks, timestamps.

A request with n > 1 samples becomes n sequences (seq_id "<request_id>#<i>") that share the
prompt's cache blocks through prefix caching.
"""

from __future__ import annotations

import enum
import time
from array import array

import torch

from inference.outputs import (
    CompletionOutput,
    FinishedSequence,
    RequestOutput,
    RequestTimes,
    TokenLogprobs,
)
from inference.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: str,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        log_context: dict | None = None,
        tenant: str | None = None,
    ) -> None:
        self.seq_id, self.request_id, self.index = seq_id, request_id, index
        self.token_ids = list(prompt_token_ids)  # prompt then output
        # the prompt once more, handed to every output as it is (a 32K-token slice of
        # token_ids each step took 0.08 ms of a 2.7 ms decode step)
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator  # per-request RNG for seeded sampling
        self.log_context = log_context or {}  # trace_id/span_id/request_id for engine log lines
        self.tenant = tenant  # whose request: waiting sequences are admitted round-robin by it
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        # int32, as the kernels read it: a decode step copies it whole (a list of 2,048 blocks at
        # 32K tokens took 70 us a step to copy, this 5)
        self.block_table = array("i")
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.block_hashes: list[int] = []
        self.times = RequestTimes(arrival=time.monotonic())
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprobs] = []
        # params.prompt_logprobs: one per prompt token so far (the first has no context)
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]
        self.detok = None  # inference.detokenizer.IncrementalDetokenizer, set by the engine
        self.matcher = None  # llguidance.LLMatcher of a constrained sequence (structured.py)
        self.reasoning_matcher = None  # the matcher while it waits for params.reasoning_end
        # speculative decoding: the draft tokens the coming step verifies after the last token,
        # and the sequence's adaptive draft length (inference/spec_decode/speculator.py)
        self.spec_token_ids: list[int] = []
        self.draft_length = None
        self.mtp_state = None  # method "mtp": the MTP layer's next draft (spec_decode/mtp.py)
        # what the consumer has been sent so far
        self.sent_tokens = 0
        self.sent_text = 0
        self.sent_logprobs = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions asked for (params.prompt_logprobs) not yet scored: the request's
        first sequence alone scores them (its siblings share the prompt), and it reads its
        prompt through the model, never from the prefix cache, which holds no logits."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.last_token = now

    def take_output(self) -> CompletionOutput:
        """Everything generated so far, and the delta since the last call (text held back
        while it may still turn into a stop string)."""
        done = self.is_finished
        text_end = self.detok.streamable_len(done)
        text = self.detok.text
        tokens = self.output_token_ids
        out = CompletionOutput(
            index=self.index,
            text=text[:text_end],
            token_ids=tokens,
            delta_text=text[self.sent_text : text_end],
            delta_token_ids=tokens[self.sent_tokens :],
            delta_logprobs=self.logprobs[self.sent_logprobs :],
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            times=self.times,
        )
        self.sent_text, self.sent_tokens, self.sent_logprobs = (
            text_end,
            len(tokens),
            len(self.logprobs),
        )
        return out

    def finished_record(self) -> FinishedSequence:
        return FinishedSequence(
            self.request_id,
            self.seq_id,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.finish_reason,
            self.times,
        )


def request_output(request_id: str, seqs: list[Sequence]) -> RequestOutput:
    """The request's output now: each sequence's completion and delta (advancing what was sent),
    and the prompt's logprobs once every position has one."""
    completions = [seq.take_output() for seq in seqs]
    first = seqs[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None and (
        len(first.prompt_logprobs) == first.num_prompt_tokens
    ):
        prompt_logprobs = first.prompt_logprobs
    return RequestOutput(
        request_id,
        first.prompt_token_ids,
        completions,
        finished=all(s.is_finished for s in seqs),
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )
