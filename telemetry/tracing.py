"""OpenTelemetry tracing: provider set-up from OTEL_* variables, context propagation,
request phase spans and engine step spans built after the fact from engine timestamps.

Environment (the standard variables; the exporters read endpoint/headers/timeout/insecure
themselves):

  OTEL_TRACES_EXPORTER      otlp | console | none (comma-separated list allowed). When unset:
                            "otlp" if OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
                            OTEL_EXPORTER_OTLP_ENDPOINT is set, else "none".
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL
                            grpc (default, port 4317) | http/protobuf (port 4318).
  OTEL_SERVICE_NAME         default "moeserve"; OTEL_RESOURCE_ATTRIBUTES is honoured.
                            service.instance.id names the replica (telemetry/instance.py;
                            default <hostname>:<REST port>).
  OTEL_TRACES_SAMPLER(_ARG) honoured by the SDK (default parentbased_always_on).
  OTEL_BSP_*                queue size (default 2048), batch size, schedule delay.

With no exporter the provider is still a real SDK provider, so spans record and carry
trace ids for logs and exemplars; they are just not exported. Export runs on the
BatchSpanProcessor's worker thread with a bounded queue: a slow or dead collector
drops spans, it never blocks or fails a request. What happens to ended spans is counted
process-wide in `SPAN_EXPORT` (exported; dropped because the queue was full or the export
failed), which /metrics serves as moeserve_trace_spans_exported_total and
moeserve_trace_spans_dropped_total{reason}. "console" writes one JSON span per line to
stderr (stdout belongs to the JSON logs).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Link, Span, SpanContext, SpanKind
from opentelemetry.util.types import AttributeValue

from telemetry.instance import service_resource

__all__ = [
    "DROP_REASONS",
    "GENAI_PROVIDER",
    "SPAN_EXPORT",
    "SpanExportStats",
    "build_tracer_provider",
    "configure_tracing",
    "extract_context",
    "genai_request_attributes",
    "genai_response_attributes",
    "genai_span_name",
    "get_tracer",
    "inject_carrier",
    "inject_traceparent",
    "monotonic_to_unix_converter",
    "record_request_phases",
    "record_step_span",
    "shutdown_tracing",
    "span_ids",
]

TRACER_NAME = "moeserve"
GENAI_PROVIDER = "moeserve"
MAX_STEP_LINKS = 128

_provider: TracerProvider | None = None
_global_set = False
_lock = threading.Lock()

DROP_REASONS = ("queue_full", "export_failed")


class SpanExportStats:
    """Counts of what the batch span processors did with ended spans: `exported` (the
    exporter reported success) and `dropped[reason]`: "queue_full" (the processor's bounded
    queue was full when the span ended: the exporter is not keeping up) or "export_failed"
    (the exporter gave up on the batch: collector down, refused, timed out). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exported = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def add_exported(self, n: int) -> None:
        with self._lock:
            self.exported += n

    def add_dropped(self, reason: str, n: int) -> None:
        with self._lock:
            self.dropped[reason] += n

    def snapshot(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.exported, dict(self.dropped)


SPAN_EXPORT = SpanExportStats()  # the process's counts, served on /metrics


class _CountingExporter(SpanExporter):
    """Wraps an exporter: each batch counts as exported or as dropped (export_failed)."""

    def __init__(self, inner: SpanExporter, stats: SpanExportStats) -> None:
        self.inner, self.stats = inner, stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            self.stats.add_dropped("export_failed", len(spans))
            raise
        if result is SpanExportResult.SUCCESS:
            self.stats.add_exported(len(spans))
        else:
            self.stats.add_dropped("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that counts the spans its full queue drops (the SDK only logs
    them). The queue is the SDK's bounded deque (opentelemetry-sdk >= 1.33); on another
    layout nothing is counted as queue_full, and spans flow as before."""

    def __init__(self, exporter: SpanExporter, stats: SpanExportStats) -> None:
        super().__init__(_CountingExporter(exporter, stats))
        self._stats = stats
        self._queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if (
            queue is not None
            and queue.maxlen is not None
            and len(queue) >= queue.maxlen
            and span.context is not None
            and span.context.trace_flags.sampled
        ):
            self._stats.add_dropped("queue_full", 1)
        super().on_end(span)


# --------------------------------------------------------------------------- set-up


def _exporter_names() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    if "none" in names:
        return []
    unknown = set(names) - {"otlp", "console"}
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported {sorted(unknown)} (otlp|console|none)")
    return names


def _otlp_exporter() -> SpanExporter:
    protocol = (
        (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        .strip()
        .lower()
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return HTTPSpanExporter()
    raise ValueError(f"OTLP protocol {protocol!r} unsupported (grpc|http/protobuf)")


def _console_exporter() -> SpanExporter:
    return ConsoleSpanExporter(
        out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n"
    )


def build_tracer_provider(
    service_name: str | None = None, *, exporters: Sequence[SpanExporter] | None = None
) -> TracerProvider:
    """A fresh SDK TracerProvider (no global state touched).

    `exporters=None` chooses them from OTEL_TRACES_EXPORTER (see module doc); an explicit
    list (e.g. an InMemorySpanExporter in tests) replaces that choice. Each exporter gets
    its own BatchSpanProcessor (bounded queue, drops when full), counted in `SPAN_EXPORT`.
    """
    provider = TracerProvider(resource=service_resource(service_name))
    if exporters is None:
        factories = {"otlp": _otlp_exporter, "console": _console_exporter}
        exporters = [factories[n]() for n in _exporter_names()]
    for exporter in exporters:
        provider.add_span_processor(_CountingBatchSpanProcessor(exporter, SPAN_EXPORT))
    return provider


def configure_tracing(
    service_name: str | None = None,
    *,
    exporters: Sequence[SpanExporter] | None = None,
    set_global: bool = True,
) -> TracerProvider:
    """Build the process's TracerProvider once and make it global; later calls return it.

    `set_global=False` (tests) builds a new provider each call and makes it the one
    `get_tracer()` uses without touching OTel's global (which can be set only once).
    """
    global _provider, _global_set
    with _lock:
        if set_global and _global_set and _provider is not None:
            return _provider
        provider = build_tracer_provider(service_name, exporters=exporters)
        if set_global and not _global_set:
            trace.set_tracer_provider(provider)
            _global_set = True
        _provider = provider
        return provider


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """Tracer from the provider configure_tracing built, else OTel's global one."""
    provider = _provider
    return provider.get_tracer(name) if provider is not None else trace.get_tracer(name)


def shutdown_tracing(timeout_s: float = 5.0) -> bool:
    """Flush and shut down the configured provider, waiting at most `timeout_s`.

    Returns True when it finished in time. A dead collector cannot hold up process exit:
    the shutdown runs on a daemon thread that is abandoned after the timeout.
    """
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is None:
        return True
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()


# --------------------------------------------------------------------------- propagation


def extract_context(carrier: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> otel_context.Context:
    """Context from W3C `traceparent`/`tracestate` (and baggage) in HTTP headers or gRPC
    metadata (a mapping or (key, value) pairs; keys are matched case-insensitively)."""
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    headers = {str(k).lower(): v for k, v in items if isinstance(v, str)}
    return propagate.extract(headers)


def inject_carrier(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The current (or given) context as a plain dict, e.g. to hand to the engine core."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def inject_traceparent(span: Span) -> str | None:
    """The W3C `traceparent` value identifying `span` (None for an invalid span)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def span_ids(span: Span | None = None) -> tuple[str, str] | None:
    """(trace_id 32 hex, span_id 16 hex) of `span` (default: the current one), or None."""
    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# --------------------------------------------------------------------------- clocks


def monotonic_to_unix_converter() -> Callable[[float], int]:
    """A time.monotonic() seconds -> Unix epoch nanoseconds converter whose offset is read
    now. Read per trace, not once at import: NTP may step the wall clock while the server
    runs and OTel stamps parent spans with time.time_ns(), so a frozen offset would pull
    child spans away from their parent; one offset for all of a trace's stamps keeps its
    durations exact."""
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda t: offset_ns + round(t * 1e9)


# --------------------------------------------------------------------------- spans


def record_request_phases(
    parent_span: Span,
    times: Any,
    to_unix_ns: Callable[[float], int] | None = None,
    *,
    tracer: trace.Tracer | None = None,
) -> None:
    """Child spans "queue", "prefill", "decode" and a "first_token" event on `parent_span`,
    from a finished request's engine timestamps (`RequestTimes`-like: arrival,
    first_scheduled, first_token, last_token, finished as time.monotonic() seconds,
    num_preemptions). Call before ending the parent. A constrained request (its times carry
    grammar_compile_s) also gets a "grammar_compile" span from arrival, with attribute
    moeserve.grammar.cache_hit.

    A request aborted early gets the phases it reached, each ending at `finished`.
    """
    if not parent_span.is_recording():
        return
    tracer = tracer or get_tracer()
    to_unix_ns = to_unix_ns or monotonic_to_unix_converter()
    parent_ctx = trace.set_span_in_context(parent_span)
    end = times.finished
    if end is None:
        end = times.last_token if times.last_token is not None else time.monotonic()
    end_ns = to_unix_ns(end)

    def phase(name: str, start: float, stop_ns: int, attributes=None) -> None:
        start_ns = to_unix_ns(start)
        span = tracer.start_span(
            name, context=parent_ctx, start_time=start_ns, attributes=attributes
        )
        span.end(end_time=max(start_ns, stop_ns))

    compile_s = getattr(times, "grammar_compile_s", None)
    if compile_s is not None:
        cache_hit = bool(getattr(times, "grammar_cache_hit", False))
        end_compile = to_unix_ns(times.arrival + compile_s)
        phase(
            "grammar_compile", times.arrival, end_compile, {"moeserve.grammar.cache_hit": cache_hit}
        )
    scheduled, first_token = times.first_scheduled, times.first_token
    phase("queue", times.arrival, to_unix_ns(scheduled) if scheduled is not None else end_ns)
    if scheduled is not None:
        phase("prefill", scheduled, to_unix_ns(first_token) if first_token is not None else end_ns)
    if first_token is not None:
        phase("decode", first_token, end_ns)
        parent_span.add_event("first_token", timestamp=to_unix_ns(first_token))
    parent_span.set_attribute("moeserve.request.num_preemptions", int(times.num_preemptions))


def record_step_span(
    step_stats: Any,
    links_by_request_id: Callable[[str], SpanContext | None],
    *,
    tracer: trace.Tracer | None = None,
    max_links: int = MAX_STEP_LINKS,
) -> Span:
    """An "engine_step" root span for one `StepStats`-like step, timed from its
    started_unix_ns/duration_s, linked to the spans of (at most `max_links`) requests in
    the batch; `links_by_request_id` returns a request's span context or None."""
    tracer = tracer or get_tracer()
    links = []
    for request_id in step_stats.request_ids[:max_links]:
        span_context = links_by_request_id(request_id)
        if span_context is not None and span_context.is_valid:
            links.append(Link(span_context))
    start_ns = int(step_stats.started_unix_ns)
    attributes: dict[str, AttributeValue] = {
        "moeserve.engine.batch_size": step_stats.batch_size,
        "moeserve.engine.num_prefill_tokens": step_stats.num_prefill_tokens,
        "moeserve.engine.num_decode_tokens": step_stats.num_decode_tokens,
        "moeserve.engine.num_generated_tokens": step_stats.num_generated_tokens,
        "moeserve.engine.num_running": step_stats.num_running,
        "moeserve.engine.num_waiting": step_stats.num_waiting,
        "moeserve.engine.kv_cache_usage": float(step_stats.kv_usage),
        "moeserve.engine.num_preemptions": step_stats.num_preemptions,
    }
    bitmask_s = getattr(step_stats, "bitmask_s", 0.0)
    if bitmask_s > 0:  # grammar masks and logit_bias: only on steps that had any
        attributes["moeserve.step.bitmask_s"] = float(bitmask_s)
    drafted = getattr(step_stats, "spec_num_draft_tokens", 0)
    if drafted:  # speculative decoding: this step's verified drafts and what they kept
        attributes["moeserve.spec_decode.num_drafts"] = step_stats.spec_num_drafts
        attributes["moeserve.spec_decode.num_draft_tokens"] = drafted
        attributes["moeserve.spec_decode.num_accepted_tokens"] = step_stats.spec_num_accepted_tokens
    if len(step_stats.request_ids) > max_links:
        attributes["moeserve.engine.links_dropped"] = len(step_stats.request_ids) - max_links
    span = tracer.start_span(
        "engine_step",
        context=otel_context.Context(),  # a root: steps belong to no single request
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        links=links,
        start_time=start_ns,
    )
    span.end(end_time=start_ns + round(step_stats.duration_s * 1e9))
    return span


# --------------------------------------------------------------------------- GenAI semconv


def genai_span_name(operation: str, model: str) -> str:
    """Semconv span name `{gen_ai.operation.name} {gen_ai.request.model}`."""
    return f"{operation} {model}"


def genai_request_attributes(
    operation: str,
    model: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    choice_count: int = 1,
    stream: bool | None = None,
    stop_sequences: Sequence[str] | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
) -> dict[str, AttributeValue]:
    """GenAI request attributes with the current semconv names.

    operation: "chat" | "text_completion" | "generate_content". top_k <= 0 means
    disabled and is left out; choice count only when != 1 (as the convention says).
    """
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": GENAI_PROVIDER,
        "gen_ai.request.model": model,
    }
    optional: dict[str, AttributeValue | None] = {
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": None if temperature is None else float(temperature),
        "gen_ai.request.top_p": None if top_p is None else float(top_p),
        "gen_ai.request.top_k": float(top_k) if top_k is not None and top_k > 0 else None,
        "gen_ai.request.seed": seed,
        "gen_ai.request.stream": stream,
        "gen_ai.request.stop_sequences": list(stop_sequences) if stop_sequences else None,
        "gen_ai.request.frequency_penalty": frequency_penalty,
        "gen_ai.request.presence_penalty": presence_penalty,
        "gen_ai.request.choice.count": choice_count if choice_count != 1 else None,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


def genai_response_attributes(
    *,
    response_id: str | None = None,
    finish_reasons: Sequence[str | None] | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    response_model: str | None = None,
    cached_input_tokens: int | None = None,
) -> dict[str, AttributeValue]:
    """GenAI response/usage attributes with the current semconv names."""
    optional: dict[str, AttributeValue | None] = {
        "gen_ai.response.id": response_id,
        "gen_ai.response.model": response_model,
        "gen_ai.response.finish_reasons": (
            [r for r in finish_reasons if r] if finish_reasons is not None else None
        ),
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.usage.cache_read.input_tokens": cached_input_tokens,
    }
    return {k: v for k, v in optional.items() if v is not None}
