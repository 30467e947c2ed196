"""One call per finished request, shared by the REST and gRPC front ends: phase spans and
GenAI usage attributes on the request's span, Prometheus request metrics with a trace-id
exemplar, and the one summary log line (SPEC section 8)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from opentelemetry.trace import Span, Tracer

from telemetry.logging import get_logger
from telemetry.metrics import NO_KEY, RequestLatencies, ServiceMetrics, request_latencies
from telemetry.tracing import genai_response_attributes, record_request_phases, span_ids

__all__ = ["finish_request", "merged_times", "per_request_metrics"]

_log = get_logger("moeserve.request")


def finish_request(
    span: Span,
    *,
    api: str,
    request_id: str,
    times: Any,
    num_prompt_tokens: int,
    num_output_tokens: int,
    finish_reason: str | None,
    status: str = "ok",
    metrics: ServiceMetrics | None = None,
    response_id: str | None = None,
    logger: Any = None,
    tracer: Tracer | None = None,
    key: str = NO_KEY,
    **log_fields: Any,
) -> RequestLatencies:
    """Record a request the engine finished or aborted; call before ending `span`.

    `times` is the sequence's `RequestTimes`; a constrained request's grammar_compile_s goes
    to moeserve_grammar_compile_seconds and a "grammar_compile" span. The summary line
    carries trace_id/span_id of `span` explicitly, so it may be called from any thread or
    task. `key` is the name of the request's API key (metrics label and log field). Extra
    keyword arguments go into the log line (never prompt or output text unless asked for).
    """
    record_request_phases(span, times, tracer=tracer)
    span.set_attributes(
        genai_response_attributes(
            response_id=response_id,
            finish_reasons=[finish_reason],
            input_tokens=num_prompt_tokens,
            output_tokens=num_output_tokens,
        )
    )
    ids = span_ids(span)
    compile_s = getattr(times, "grammar_compile_s", None)
    if metrics is not None and compile_s is not None:
        metrics.observe_grammar_compile(compile_s, getattr(times, "grammar_cache_hit", None))
    if metrics is not None:
        # Exemplars only for sampled traces: an unsampled id leads nowhere in Tempo.
        sampled = ids is not None and span.get_span_context().trace_flags.sampled
        latencies = metrics.observe_request(
            api,
            times,
            num_prompt_tokens,
            num_output_tokens,
            finish_reason,
            status,
            ids[0] if sampled else None,
            key,
        )
    else:
        latencies = request_latencies(times, num_output_tokens)
    _summary_line(
        logger,
        span,
        request_id,
        api,
        num_prompt_tokens,
        num_output_tokens,
        latencies.log_fields(),
        finish_reason,
        status,
        {"key": key, **log_fields},
    )
    return latencies


def finish_unserved_request(
    span: Span,
    *,
    api: str,
    request_id: str,
    num_prompt_tokens: int,
    finish_reason: str | None,
    status: str,
    metrics: ServiceMetrics | None = None,
    logger: Any = None,
    key: str = NO_KEY,
    **log_fields: Any,
) -> None:
    """Record a request that never produced an output (rejected, invalid, aborted while
    queued): counted, and one summary line with no latencies."""
    if metrics is not None:
        metrics.count_request(api, status, finish_reason, key)
    _summary_line(
        logger,
        span,
        request_id,
        api,
        num_prompt_tokens,
        0,
        RequestLatencies(None, None, None, None).log_fields(),
        finish_reason,
        status,
        {"key": key, **log_fields},
    )


def _summary_line(
    logger: Any,
    span: Span,
    request_id: str,
    api: str,
    num_prompt_tokens: int,
    num_output_tokens: int,
    latencies: dict[str, float | None],
    finish_reason: str | None,
    status: str,
    log_fields: dict[str, Any],
) -> None:
    """The one "request finished" line; it names the span's trace and span ids itself, so it
    may be written from any thread or task."""
    ids = span_ids(span)
    (logger or _log).info(
        "request finished",
        request_id=request_id,
        api=api,
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        **latencies,
        finish_reason=finish_reason or "none",
        status=status,
        **({"trace_id": ids[0], "span_id": ids[1]} if ids else {}),
        **log_fields,
    )


def merged_times(outputs: list[Any]) -> Any:
    """One RequestTimes for the request: the sample's own, or for n > 1 the envelope of
    all samples (earliest start and first token, latest finish, preemptions summed; the
    grammar, compiled once for all samples, as the first sample has it)."""
    times = [c.times for c in outputs if c.times is not None]
    if len(times) <= 1:
        return times[0] if times else None

    def first(name: str) -> float | None:
        values = [getattr(t, name) for t in times if getattr(t, name) is not None]
        return min(values) if values else None

    finished = [t.finished for t in times]
    return SimpleNamespace(
        arrival=min(t.arrival for t in times),
        first_scheduled=first("first_scheduled"),
        first_token=first("first_token"),
        last_token=max((t.last_token for t in times if t.last_token is not None), default=None),
        finished=None if None in finished else max(finished),
        num_preemptions=sum(t.num_preemptions for t in times),
        grammar_compile_s=getattr(times[0], "grammar_compile_s", None),
        grammar_cache_hit=getattr(times[0], "grammar_cache_hit", None),
        # speculative decoding: every sample's drafts
        spec_draft_tokens=sum(getattr(t, "spec_draft_tokens", 0) for t in times),
        spec_accepted_tokens=sum(getattr(t, "spec_accepted_tokens", 0) for t in times),
    )


def per_request_metrics(latencies: RequestLatencies, num_output_tokens: int) -> dict:
    """vLLM's per-request `metrics` object from the latencies the histograms observe for the
    same request (so its TTFT is its moeserve_time_to_first_token_seconds observation):
    time_to_first_token_ms (TTFT), generation_time_ms (e2e: arrival to the last token),
    queue_time_ms, mean_itl_ms (TPOT: mean gap between output tokens after the first) and
    tokens_per_second (output tokens / e2e). None where the request never got that far."""

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else max(seconds, 0.0) * 1e3

    e2e = latencies.e2e
    return {
        "time_to_first_token_ms": ms(latencies.ttft),
        "generation_time_ms": ms(e2e),
        "queue_time_ms": ms(latencies.queue),
        "mean_itl_ms": ms(latencies.tpot),
        "tokens_per_second": num_output_tokens / e2e if e2e else None,
    }
