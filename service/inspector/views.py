"""Records -> the inspector API's bodies. Prompt and output text appear only when the
recorder was built with --log-prompts (it keeps none otherwise)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from inference import AsyncLLMEngine
from service.inspector.engine_window import HEATMAP_S
from service.inspector.expert_view import experts_view
from service.inspector.recorder import InspectorRecorder
from service.inspector.requests import RequestRecord, StepRecord
from service.inspector.schemas import (
    Filter,
    InspectorEngine,
    InspectorPeer,
    InspectorPhase,
    InspectorRequest,
    InspectorRequestDetail,
    InspectorRequestList,
    InspectorSeries,
    InspectorStep,
)
from service.responses import RequestMetrics
from telemetry.requests import per_request_metrics

MAX_PEERS = 16  # other requests named per step
_OUTCOME_OF_FILTER = {"errors": "error", "aborts": "aborted", "rejected": "rejected"}
_timestamp = msgspec.json.Decoder(dict)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def summary(record: RequestRecord, slow_s: float | None) -> InspectorRequest:
    lat = record.latencies
    e2e = lat.e2e if lat is not None else None
    times = record.times
    return InspectorRequest(
        id=record.id,
        request_id=record.request_id,
        response_id=record.response_id,
        api=record.api,
        key=record.telemetry.key if record.telemetry is not None else record.key,
        operation=record.operation,
        stream=record.stream,
        started_at=record.started_at,
        outcome=record.outcome,
        status=record.status,
        code=record.code,
        error=record.error,
        finish_reason=record.finish_reason,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        queue_ms=_ms(lat and lat.queue),
        ttft_ms=_ms(lat and lat.ttft),
        tpot_ms=_ms(lat and lat.tpot),
        e2e_ms=_ms(e2e),
        preemptions=times.num_preemptions if times is not None else 0,
        trace_id=record.trace_id,
        slow=e2e is not None and slow_s is not None and e2e > slow_s,
        spec_draft_tokens=getattr(times, "spec_draft_tokens", 0),
        spec_accepted_tokens=getattr(times, "spec_accepted_tokens", 0),
    )


def request_list(recorder: InspectorRecorder, which: Filter, limit: int) -> InspectorRequestList:
    slow_s = recorder.slow_threshold_s()
    outcome = _OUTCOME_OF_FILTER.get(which)
    rows = []
    for record in recorder.newest_first():
        if len(rows) >= limit:
            break
        row = summary(record, slow_s)
        if (outcome is None or row.outcome == outcome) and (which != "slow" or row.slow):
            rows.append(row)
    return InspectorRequestList(
        requests=rows,
        capacity=recorder.capacity,
        recorded=recorder.recorded,
        slow_threshold_ms=_ms(slow_s),
    )


def _phases(times: Any, end: float) -> list[InspectorPhase]:
    """queue (arrival -> first scheduled), prefill (-> first token), decode (-> finished),
    each up to `end` while it has not ended."""
    arrival = times.arrival
    marks = [
        ("queue", arrival, times.first_scheduled),
        ("prefill", times.first_scheduled, times.first_token),
        ("decode", times.first_token, times.finished or times.last_token),
    ]
    phases = []
    for name, start, stop in marks:
        if start is None:
            break
        stop = stop if stop is not None else end
        phases.append(
            InspectorPhase(
                name=name, start_ms=_ms(start - arrival), end_ms=_ms(max(stop, start) - arrival)
            )
        )
    return phases


def _step(step: StepRecord, record: RequestRecord, times: Any, ids: dict[str, str]):
    others = [rid for rid in step.request_ids if rid != record.response_id]
    first_token = times.first_token
    return InspectorStep(
        index=step.index,
        at_ms=_ms(step.started - times.arrival),
        duration_ms=_ms(step.duration_s),
        phase="prefill" if first_token is None or step.started < first_token else "decode",
        batch_size=step.batch_size,
        prefill_tokens=step.prefill_tokens,
        decode_tokens=step.decode_tokens,
        kv_usage=round(step.kv_usage, 4),
        others=[InspectorPeer(response_id=rid, id=ids.get(rid)) for rid in others[:MAX_PEERS]],
        others_count=len(others),
    )


def _by_time(lines: list[str]) -> list[str]:
    """The API's and the engine core's lines in one order (ISO UTC timestamps sort)."""

    def key(line: str) -> str:
        try:
            return str(_timestamp.decode(line).get("timestamp", ""))
        except msgspec.DecodeError:
            return ""

    return sorted(lines, key=key)


def detail(
    recorder: InspectorRecorder, record: RequestRecord, decode: Callable[[list[int]], str]
) -> InspectorRequestDetail:
    times = record.current_times()
    end = record.ended if record.ended is not None else time.monotonic()
    steps: list[InspectorStep] = []
    if times is not None:
        ids = recorder.ids_by_response_id()
        steps = [_step(s, record, times, ids) for s in record.steps]
    prompt = outputs = None
    if recorder.log_prompts:
        prompt = decode(record.prompt_ids) if record.prompt_ids is not None else None
        live = record.telemetry.output if record.telemetry is not None else None
        outputs = [c.text for c in live.outputs] if live is not None else record.outputs
    return InspectorRequestDetail(
        request=summary(record, recorder.slow_threshold_s()),
        phases=_phases(times, end) if times is not None else [],
        first_token_ms=_ms(times.first_token - times.arrival)
        if times is not None and times.first_token is not None
        else None,
        steps=steps,
        steps_omitted=record.num_steps - len(steps),
        logs=_by_time(recorder.logs.lines(record.trace_id)) if record.trace_id else [],
        trace_url=recorder.trace_url(record.trace_id),
        prompt=prompt,
        outputs=outputs,
        metrics=_metrics(record),
    )


def _metrics(record: RequestRecord) -> RequestMetrics | None:
    """What the request's `include_metrics` response said: its latencies as the metrics
    observed them (RequestRecord.close), in vLLM's per-request form."""
    if record.latencies is None:
        return None
    return RequestMetrics(**per_request_metrics(record.latencies, record.completion_tokens))


def engine_view(
    recorder: InspectorRecorder,
    engine: AsyncLLMEngine,
    model_name: str,
    in_flight: int,
    instance_id: str | None,
) -> InspectorEngine:
    """The engine now (`in_flight`: the server's requests in it, `instance_id`: its replica)
    and its recorded window."""
    window, now = recorder.window, time.time()
    return InspectorEngine(
        model=model_name,
        instance=instance_id,
        running=engine.num_running,
        waiting=engine.num_waiting,
        in_flight=in_flight,
        kv_usage=round(engine.kv_usage, 4),
        kv_blocks_used=engine.kv_blocks_used,
        steps=recorder.steps,
        series=InspectorSeries(**window.series(now)),
        experts=experts_view(window.expert_counts(now), HEATMAP_S) if window.num_layers else None,
    )
