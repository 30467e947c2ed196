"""One recorded request, and the engine steps it was in.

A RequestRecord follows its Generation's RequestTelemetry while the request runs and keeps a
copy of what mattered once it is over (the telemetry object itself is let go). Its steps are
shared StepRecords: the first MAX_HEAD_STEPS (queue, prefill chunks, first decode steps) and
the last MAX_TAIL_STEPS, so a long generation costs no more than a short one.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from telemetry.metrics import RequestLatencies, request_latencies
from telemetry.requests import merged_times
from telemetry.tracing import span_ids

MAX_HEAD_STEPS = 64
MAX_TAIL_STEPS = 192


class StepRecord:
    """One engine step, as the requests in it show it."""

    __slots__ = (
        "batch_size",
        "decode_tokens",
        "duration_s",
        "index",
        "kv_usage",
        "prefill_tokens",
        "request_ids",
        "started",
    )

    def __init__(self, index: int, stats: Any) -> None:
        self.index = index
        self.started = stats.started  # monotonic, as RequestTimes
        self.duration_s = stats.duration_s
        self.batch_size = stats.batch_size
        self.prefill_tokens = stats.num_prefill_tokens
        self.decode_tokens = stats.num_decode_tokens
        self.kv_usage = stats.kv_usage
        self.request_ids = stats.request_ids  # the engine's ids, shared with StepStats


def outcome_of(status: str | None, abandoned: bool) -> str:
    """in_progress | ok | error | aborted (the caller left) | rejected (queue full)."""
    if status is None:
        return "in_progress"
    if abandoned:
        return "aborted"
    return status if status in ("ok", "rejected") else "error"


def _message(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    text = getattr(exc, "message", None) or getattr(exc, "detail", None) or str(exc)
    return str(text) or type(exc).__name__


class RequestRecord:
    def __init__(self, record_id: str, telemetry: Any) -> None:
        self.id = record_id
        self.telemetry = telemetry  # the live RequestTelemetry; None once closed
        self.api: str = telemetry.api
        self.started_at = time.time()
        ids = span_ids(telemetry.span)
        self.trace_id = ids[0] if ids else None
        self._request_id: str = telemetry.request_id
        self.response_id: str | None = None
        self.operation: str | None = None
        self.stream: bool | None = None
        self.outcome = "in_progress"
        self.status: str | None = None
        self.code: str | None = None
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.key: str = telemetry.key  # the API key's name (never the key), once checked
        self.prompt_tokens = self.completion_tokens = 0
        self.times: Any = None  # RequestTimes (merged over choices) once closed
        self.latencies: RequestLatencies | None = None
        self.ended: float | None = None  # monotonic, when the API answered
        self.prompt_ids: list[int] | None = None  # only kept with --log-prompts
        self.outputs: list[str] | None = None  # likewise
        self.head: list[StepRecord] = []
        self.tail: deque[StepRecord] | None = None
        self.num_steps = 0

    @property
    def request_id(self) -> str:
        """The caller's id (gRPC learns it after the record is opened)."""
        return self.telemetry.request_id if self.telemetry is not None else self._request_id

    def admit(self, spec: Any, keep_text: bool) -> None:
        """The request enters the engine (spec: its validation.GenerationInput)."""
        self.response_id = self.telemetry.engine_request_id
        self.operation, self.stream = spec.operation, spec.stream
        self.prompt_tokens = len(spec.prompt_ids)
        if keep_text:
            self.prompt_ids = spec.prompt_ids

    def add_step(self, step: StepRecord) -> None:
        self.num_steps += 1
        if len(self.head) < MAX_HEAD_STEPS:
            self.head.append(step)
            return
        if self.tail is None:
            self.tail = deque(maxlen=MAX_TAIL_STEPS)
        self.tail.append(step)

    @property
    def steps(self) -> list[StepRecord]:
        return self.head + list(self.tail or ())

    def current_times(self) -> Any:
        """RequestTimes as of now (a running request's last output; None before its first)."""
        if self.telemetry is None:
            return self.times
        out = self.telemetry.output
        return merged_times(out.outputs) if out is not None else None

    def close(self, code: str | None, keep_text: bool) -> None:
        """The API has answered: keep what the finished telemetry says, then let it go."""
        t = self.telemetry
        self.ended = time.monotonic()
        self._request_id = t.request_id
        self.key = t.key
        self.status = t.status
        self.outcome = outcome_of(t.status, t.abandoned)
        # nginx's 499 for a client that left, also after a stream's 200 went out
        self.code = "499" if self.outcome == "aborted" and self.api == "rest" else code
        self.error = _message(t.failure)
        self.finish_reason = t.finish_reason
        out = t.output
        if out is not None:
            self.times = merged_times(out.outputs)
            self.prompt_tokens = len(out.prompt_token_ids)
            self.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            if self.times is not None:
                self.latencies = request_latencies(self.times, self.completion_tokens)
            if keep_text:
                self.outputs = [c.text for c in out.outputs]
        self.telemetry = None
