"""What the engine hands back: per-request outputs and per-step statistics, as plain data.

Telemetry consumes these without the engine knowing about it (vLLM v1's "observability
is data"): the engine never imports prometheus or OTel.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct):
    """Log-probability of one generated token plus the top-N alternatives at its position."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = []
    rank: int | None = None  # prompt logprobs: the token's rank in its distribution (1: best)


class RequestTimes(msgspec.Struct):
    """Monotonic timestamps (time.monotonic seconds) of one sequence's life in the engine."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    # constrained sequences only: seconds compiling the grammar (from arrival), whether the
    # compiled grammar came from the cache
    grammar_compile_s: float | None = None
    grammar_cache_hit: bool | None = None
    # speculative decoding: draft tokens verified for this sequence, and those accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class CompletionOutput(msgspec.Struct):
    """One sample of a request. `text`/`token_ids` are cumulative, `delta_*` new since the
    previous RequestOutput the consumer saw (deltas merge when the consumer lags)."""

    index: int
    text: str = ""
    token_ids: list[int] = []
    delta_text: str = ""
    delta_token_ids: list[int] = []
    delta_logprobs: list[TokenLogprobs] = []
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that matched
    times: RequestTimes | None = None


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: each prompt token's (None for the first), once the
    # prompt has been read
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class FinishedSequence(msgspec.Struct):
    """Emitted once per finished (or aborted) sequence, for request-level telemetry."""

    request_id: str
    seq_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str
    times: RequestTimes


class StepStats(msgspec.Struct):
    """One engine step (schedule -> forward -> sample -> update)."""

    started: float  # time.monotonic()
    started_unix_ns: int  # wall clock, for spans
    duration_s: float
    num_running: int
    num_waiting: int
    batch_size: int  # sequences in this step
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    kv_usage: float  # blocks held by live requests / all blocks
    kv_blocks_used: int
    num_requests: int  # unfinished requests in the engine after this step
    num_preemptions: int
    request_ids: list[str]  # requests in the batch (span links)
    # vLLM's prefix-cache stats, in tokens, of the requests admitted this step (never counting
    # one resumed after a preemption): prompt tokens looked up, and those found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    expert_tokens: np.ndarray | None = None  # int64 [layer, expert] routed token counts
    bitmask_s: float = 0.0  # grammar masks and logit_bias this step cost the step
    # speculative decoding, vLLM's meanings: sequences whose drafts this step verified, their
    # draft tokens, those accepted, and accepted ones by draft position (index 0: the first)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    finished: list[FinishedSequence] = []
    # (trace_id, JSON line) of the lines the engine core logged on requests' behalf since
    # its previous step, when its process_init captures them (the inspector shows them)
    log_lines: list[tuple[str, str]] = []


# Arrays cross the engine core's pipe as one buffer (msgspec's hooks for a type it does not
# know): expert_tokens at 256 experts x 60 layers took ~1 ms a step as nested lists (built,
# encoded, decoded, turned back into an array), ~20 us as bytes.
def wire_encoder() -> msgspec.msgpack.Encoder:
    """The engine core pipe's encoder (both ends)."""
    return msgspec.msgpack.Encoder(enc_hook=encode_array)


def wire_decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """The engine core pipe's decoder of `kind` messages."""
    return msgspec.msgpack.Decoder(kind, dec_hook=decode_array)


def encode_array(obj: object) -> object:
    """msgspec enc_hook: an ndarray -> (dtype, shape, bytes)."""
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def decode_array(kind: type, obj: object) -> object:
    """msgspec dec_hook: (dtype, shape, bytes) -> the ndarray (read-only, on the message)."""
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")
