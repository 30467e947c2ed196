"""What the inspector knows: the last `capacity` requests, the engine's last minutes and the
log lines of recent traces, recorded from what the pipeline already has.

Hooks, all on the event loop: `open`/`admit`/`close` from each request's
service.generation.Generation, `on_step` after every engine step (a stats listener). Per
step the work is O(batch): one StepRecord shared by the requests in the step, appended to
each one's bounded step list, and the step's one-second bucket (engine_window.py). Nothing
runs per token. Log lines come from telemetry.logging's line sink (any thread) and from the
engine core with its steps (StepStats.log_lines).

Memory is bounded by the ring sizes: `capacity` requests, each with at most
MAX_HEAD_STEPS + MAX_TAIL_STEPS step references; log lines of 2 x `capacity` traces, at
most LogRing.max_lines each; SERIES_S one-second buckets.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from inference import InvalidParameterError
from service.inspector.engine_window import EngineWindow
from service.inspector.log_ring import LogRing
from service.inspector.requests import RequestRecord, StepRecord
from telemetry.logging import add_line_sink, get_logger, remove_line_sink

log = get_logger("service.inspector")
TRACE_ID_FIELD = "{trace_id}"
F = TypeVar("F", bound=Callable[..., Any])


def _failsafe(hook: F) -> F:
    """A request hook whose errors are logged, never raised: the inspector must not fail a
    request (the engine guards its stats listeners, on_step included, the same way)."""

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except Exception:
            log.exception("inspector hook failed", hook=hook.__name__)
            return None

    return guarded  # type: ignore[return-value]


class InspectorRecorder:
    def __init__(
        self,
        capacity: int,
        *,
        log_prompts: bool = False,
        trace_url_template: str | None = None,
    ) -> None:
        """Raises InvalidParameterError for settings it cannot work with (start-up fails)."""
        if capacity < 1:
            raise InvalidParameterError("inspector_requests", "must be at least 1")
        if trace_url_template is not None and TRACE_ID_FIELD not in trace_url_template:
            raise InvalidParameterError(
                "trace_url_template", f"must contain {TRACE_ID_FIELD}: {trace_url_template!r}"
            )
        self.capacity = capacity
        self.log_prompts = log_prompts
        self.trace_url_template = trace_url_template
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()  # oldest first
        self.recorded = 0
        self.steps = 0
        self.logs = LogRing(max_traces=2 * capacity)
        self.window = EngineWindow(0, 0)
        self._live: dict[str, RequestRecord] = {}  # engine request id -> running record
        self._engine: Any = None

    # ---- wiring -----------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Starts recording `engine`'s steps (an AsyncLLMEngine) and this process's log lines."""
        args = engine.args
        layers = args.num_moe_layers
        self.window = EngineWindow(layers, args.num_experts if layers else 0)
        self._engine = engine
        engine.add_stats_listener(self.on_step)
        add_line_sink(self.logs.add)

    def detach(self) -> None:
        remove_line_sink(self.logs.add)
        if self._engine is not None:
            self._engine.remove_stats_listener(self.on_step)

    # ---- one request ------------------------------------------------------------------------
    @_failsafe
    def open(self, telemetry: Any) -> RequestRecord | None:
        """A request arrived (its RequestTelemetry, which the record reads while it runs)."""
        self.recorded += 1
        record = RequestRecord(str(self.recorded), telemetry)
        self.records[record.id] = record
        if len(self.records) > self.capacity:
            self.records.popitem(last=False)
        return record

    @_failsafe
    def admit(self, record: RequestRecord, spec: Any) -> None:
        """It enters the engine: from now on the steps that name it are its steps."""
        record.admit(spec, self.log_prompts)
        if record.response_id is not None:
            self._live[record.response_id] = record

    @_failsafe
    def close(self, record: RequestRecord, code: str | None) -> None:
        """The API has answered it (`code`: the HTTP status or gRPC code name sent); once."""
        if record.telemetry is None:
            return
        if record.response_id is not None:
            self._live.pop(record.response_id, None)
        record.close(code, self.log_prompts)

    # ---- the engine -------------------------------------------------------------------------
    def on_step(self, stats: Any) -> None:
        """Stats listener: after every engine step."""
        for trace_id, line in stats.log_lines:
            self.logs.add(trace_id, line)
        if not stats.batch_size:  # a step that only reports aborted sequences
            return
        self.steps += 1
        step = StepRecord(self.steps, stats)
        live = self._live
        for rid in stats.request_ids:
            record = live.get(rid)
            if record is not None:
                record.add_step(step)
        self.window.observe(stats)

    # ---- queries ----------------------------------------------------------------------------
    def newest_first(self) -> Iterator[RequestRecord]:
        return reversed(self.records.values())

    def find(self, key: str) -> RequestRecord | None:
        """By the inspector's id, else the newest with that request id, engine id or trace id."""
        record = self.records.get(key)
        if record is not None:
            return record
        for record in self.newest_first():
            if key in (record.request_id, record.response_id, record.trace_id):
                return record
        return None

    def slow_threshold_s(self) -> float | None:
        """The p95 (nearest rank) of e2e over the recorded requests that have one."""
        e2e = sorted(r.latencies.e2e for r in self.records.values() if _has_e2e(r))
        if not e2e:
            return None
        return e2e[max(math.ceil(0.95 * len(e2e)) - 1, 0)]

    def trace_url(self, trace_id: str | None) -> str | None:
        if trace_id is None or self.trace_url_template is None:
            return None
        return self.trace_url_template.replace(TRACE_ID_FIELD, trace_id)

    def ids_by_response_id(self) -> dict[str, str]:
        return {r.response_id: r.id for r in self.records.values() if r.response_id is not None}


def _has_e2e(record: RequestRecord) -> bool:
    return record.latencies is not None and record.latencies.e2e is not None
