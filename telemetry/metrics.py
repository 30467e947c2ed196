"""Prometheus metrics (SPEC section 8): every instrument defined once per registry.

`ServiceMetrics(registry, model, ...)` creates all instruments and pre-initialises every
known label set so each metric is exported from start-up. The engine's `StepStats` go to
`observe_step` (every step: gauges, batch size, step time, expert load), finished requests
to `observe_request` (latency histograms with trace-id exemplars, tokens, outcome), and
requests that never reached the engine to `count_request`/`count_rejected`. Label values
are all bounded: api and status/finish_reason are normalised to fixed sets, layer/expert
come from the model's shape (experts bucketed past a series limit: telemetry.expert_load),
`key` (an API key's name) from the service's keys file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES

from telemetry.expert_load import (
    EXPERT_SERIES_LIMIT,
    WINDOW_TOKENS_PER_EXPERT,
    ExpertLoadCollector,
)
from telemetry.metric_collectors import SpanExportCollector
from telemetry.vllm_metrics import VllmPrefixCacheCounters, VllmProtocolGauges

__all__ = [
    "APIS",
    "FINISH_REASONS",
    "NO_KEY",
    "STATUSES",
    "STRUCTURED_KINDS",
    "ExpertLoadCollector",
    "RequestLatencies",
    "ServiceMetrics",
    "SpanExportCollector",
    "render_metrics",
    "request_latencies",
    "status_from_grpc",
    "status_from_http",
]

APIS = ("rest", "grpc")
STATUSES = ("ok", "client_error", "rejected", "server_error")
FINISH_REASONS = ("stop", "length", "abort", "error", "none")
# structured_outputs kinds (inference.sampling_params.STRUCTURED_KINDS; this package imports
# no inference code)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_CACHE = ("hit", "miss")
NO_KEY = "none"  # the `key` label of requests to a server that takes no API key

# OTel GenAI server recommendations (gen_ai.server.*), extended below 1 ms (GPU decode
# steps) and above 10 s (long generations, queueing under overload).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
    20.48, 40.96, 81.92, 163.84, 327.68, 655.36, 1310.72, 2621.44,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
STEP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
    1.024, 2.048, 4.096, 8.192,
)  # fmt: skip
# a decode step's time per sequence: tens of microseconds (GPU, large batch) to a second
PER_SEQUENCE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064,
    0.128, 0.256, 0.512, 1.024,
)  # fmt: skip
# context lengths: powers of two from a one-line prompt to the longest contexts served
CONTEXT_BUCKETS = tuple(float(2**i) for i in range(4, 21))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# cache hits take microseconds, a schema of a few fields 1-2 ms, a large grammar seconds
GRAMMAR_COMPILE_BUCKETS = (
    0.00001, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_GRPC_CLIENT_ERRORS = frozenset({
    "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED",
    "FAILED_PRECONDITION", "OUT_OF_RANGE", "UNAUTHENTICATED", "DEADLINE_EXCEEDED",
})  # fmt: skip


def status_from_http(code: int) -> str:
    """HTTP status code -> requests_total `status` label."""
    if code == 429:
        return "rejected"
    if code >= 500:
        return "server_error"
    if code >= 400:
        return "client_error"
    return "ok"


def status_from_grpc(code: Any) -> str:
    """grpc.StatusCode (or its name) -> requests_total `status` label. CANCELLED and
    DEADLINE_EXCEEDED are the caller's doing and count as client errors."""
    name = getattr(code, "name", code)
    if name == "OK":
        return "ok"
    if name == "RESOURCE_EXHAUSTED":
        return "rejected"
    return "client_error" if name in _GRPC_CLIENT_ERRORS else "server_error"


class RequestLatencies(NamedTuple):
    """Per-request latencies in seconds (None where the request never got that far)."""

    queue: float | None
    ttft: float | None
    tpot: float | None  # mean time per output token after the first
    e2e: float | None

    def log_fields(self) -> dict[str, float | None]:
        """ttft_ms/tpot_ms/e2e_ms/queue_ms for the per-request summary log line."""
        return {
            f"{name}_ms": None if value is None else round(value * 1e3, 3)
            for name, value in zip(("queue", "ttft", "tpot", "e2e"), self, strict=True)
        }


def request_latencies(times: Any, num_output_tokens: int) -> RequestLatencies:
    """From `RequestTimes`-like monotonic timestamps: queue = first_scheduled - arrival,
    TTFT = first_token - arrival, e2e = finished - arrival, and
    TPOT = (e2e - TTFT) / (output tokens - 1) for requests with at least two tokens."""
    arrival, first_token, finished = times.arrival, times.first_token, times.finished
    queue = None if times.first_scheduled is None else times.first_scheduled - arrival
    ttft = None if first_token is None else first_token - arrival
    e2e = None if finished is None else finished - arrival
    tpot = None
    if first_token is not None and finished is not None and num_output_tokens > 1:
        tpot = (finished - first_token) / (num_output_tokens - 1)
    return RequestLatencies(queue, ttft, tpot, e2e)


class ServiceMetrics:
    """All moeserve_* instruments, registered on `registry` (one instance per registry)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        num_layers: int,
        num_experts: int,
        max_waiting: int,
        *,
        expert_window_tokens: int = WINDOW_TOKENS_PER_EXPERT,
        expert_series_limit: int = EXPERT_SERIES_LIMIT,
        span_export: Any = None,
        info: dict[str, str] | None = None,
        weight_bytes: int = 0,
        kv_cache_bytes: int = 0,
        kv_cache_blocks: tuple[int, int] | None = None,
    ) -> None:
        """`span_export`: the `SpanExportStats` the trace-export counters read (default: the
        process's, telemetry.tracing.SPAN_EXPORT). `info`: what moeserve_model_info labels
        (dtype, device, quantization, kv_cache_dtype); the byte counts: what is resident.
        `expert_window_tokens`: routed tokens per expert the per-layer load gauges cover;
        `expert_series_limit`: most moeserve_moe_expert_tokens_total series (past it,
        experts share series: telemetry.expert_load). `kv_cache_blocks`: (block size, number
        of blocks), for vllm:cache_config_info (telemetry.vllm_metrics)."""
        if span_export is None:
            from telemetry.tracing import SPAN_EXPORT as span_export
        self.registry = registry
        self.model = model
        self.num_layers = num_layers
        self.num_experts = num_experts
        # Registration order is exposition order: /metrics lists the families as added here.
        self._add_latency_histograms()
        self._add_request_counters()
        self._add_engine_instruments(max_waiting)
        # the same engine gauges under vLLM's names, which endpoint pickers read
        self.vllm = VllmProtocolGauges(registry, model, *(kv_cache_blocks or (None, None)))
        self._add_prefix_cache_counters()
        self._add_structured_output_instruments()
        self._add_spec_decode_counters()
        self._add_model_instruments(info or {}, weight_bytes, kv_cache_bytes)
        # moeserve_moe_expert_tokens_total, moeserve_moe_expert_imbalance and the other
        # per-layer expert-load gauges.
        self.experts = ExpertLoadCollector(
            model,
            num_layers,
            num_experts,
            window_tokens_per_expert=expert_window_tokens,
            series_limit=expert_series_limit,
        )
        registry.register(self.experts)
        # moeserve_trace_spans_exported_total and moeserve_trace_spans_dropped_total{reason}.
        registry.register(SpanExportCollector(model, span_export))

    # Each _add_* defines one group of instruments and resolves the children its hot path
    # uses once, so observe_* never goes through .labels().

    def _add_latency_histograms(self) -> None:
        """Per-request latencies: TTFT, TPOT and e2e by api (with exemplars), queue time."""
        r, model = self.registry, self.model
        self.ttft = _histogram(
            r,
            "moeserve_time_to_first_token_seconds",
            "Time from arrival in the engine to the first generated token.",
            ("model", "api"),
            TTFT_BUCKETS,
        )
        self.tpot = _histogram(
            r,
            "moeserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ("model", "api"),
            TPOT_BUCKETS,
        )
        self.e2e = _histogram(
            r,
            "moeserve_e2e_request_latency_seconds",
            "Time from arrival in the engine to the request finishing.",
            ("model", "api"),
            E2E_BUCKETS,
        )
        self.queue_time = _histogram(
            r,
            "moeserve_request_queue_time_seconds",
            "Time requests spent waiting before first being scheduled.",
            ("model",),
            QUEUE_BUCKETS,
        )
        self._ttft = {api: self.ttft.labels(model, api) for api in APIS}
        self._tpot = {api: self.tpot.labels(model, api) for api in APIS}
        self._e2e = {api: self.e2e.labels(model, api) for api in APIS}
        self._queue = self.queue_time.labels(model)
        # vLLM's per-stage histograms (its request_prefill/decode_time_seconds): where a
        # request's time went after the queue
        self.prefill_time = _histogram(
            r,
            "moeserve_request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token (prefill).",
            ("model",),
            E2E_BUCKETS,
        )
        self.decode_time = _histogram(
            r,
            "moeserve_request_decode_time_seconds",
            "Time from a request's first token to its end (decode).",
            ("model",),
            E2E_BUCKETS,
        )
        # llama.cpp's context-length histogram: how long requests' contexts are
        self.context_tokens = _histogram(
            r,
            "moeserve_request_context_tokens",
            "Tokens of each finished request's context (kind: prompt, or prompt and output).",
            ("model", "kind"),
            CONTEXT_BUCKETS,
        )
        self._prefill = self.prefill_time.labels(model)
        self._decode = self.decode_time.labels(model)
        self._context = {k: self.context_tokens.labels(model, k) for k in ("prompt", "total")}

    def _add_request_counters(self) -> None:
        """Tokens of finished requests, requests by outcome and key, rate-limit refusals."""
        r, model = self.registry, self.model
        self.prompt_tokens = Counter(
            "moeserve_prompt_tokens",
            "Prompt tokens of finished requests.",
            ("model", "api"),
            registry=r,
        )
        self.generation_tokens = Counter(
            "moeserve_generation_tokens",
            "Generated tokens of finished requests.",
            ("model", "api"),
            registry=r,
        )
        self.requests = Counter(
            "moeserve_requests",
            "Requests by outcome and API key name.",
            ("model", "api", "status", "finish_reason", "key"),
            registry=r,
        )
        self.rate_limited = Counter(
            "moeserve_rate_limited",
            "Requests refused (429 / RESOURCE_EXHAUSTED) because their API key was over one "
            "of its limits, by key name and limit.",
            ("model", "api", "key", "limit"),
            registry=r,
        )
        self._prompt = {api: self.prompt_tokens.labels(model, api) for api in APIS}
        self._generated = {api: self.generation_tokens.labels(model, api) for api in APIS}
        self._requests: dict[tuple[str, str, str, str], Any] = {}
        self._rate_limited: dict[tuple[str, str, str], Any] = {}
        self.add_key(NO_KEY)

    def _add_engine_instruments(self, max_waiting: int) -> None:
        """What each engine step reports: batch occupancy, KV cache use, step times,
        preemptions; and the waiting queue's configured bound."""
        r, model = self.registry, self.model
        self.running = Gauge(
            "moeserve_num_requests_running",
            "Requests in the running batch.",
            ("model",),
            registry=r,
        )
        self.waiting = Gauge(
            "moeserve_num_requests_waiting",
            "Requests waiting to be scheduled.",
            ("model",),
            registry=r,
        )
        self.kv_usage = Gauge(
            "moeserve_kv_cache_usage_ratio",
            "KV cache blocks held by live requests / all blocks (0-1).",
            ("model",),
            registry=r,
        )
        self.batch_size = _histogram(
            r, "moeserve_batch_size", "Sequences per engine step.", ("model",), BATCH_BUCKETS
        )
        self.step_time = _histogram(
            r, "moeserve_engine_step_seconds", "Engine step duration.", ("model",), STEP_BUCKETS
        )
        self.decode_per_sequence = _histogram(
            r,
            "moeserve_engine_decode_seconds_per_sequence",
            "Duration of an engine step that only decodes (no prefill chunk, no recompute), "
            "divided by its batch size: the same work at a different speed shows here, more "
            "work (longer prompts, bigger batches) does not.",
            ("model",),
            PER_SEQUENCE_BUCKETS,
        )
        self.preemptions = Counter(
            "moeserve_preemptions",
            "Sequences preempted (KV cache exhausted).",
            ("model",),
            registry=r,
        )
        self.max_waiting = Gauge(
            "moeserve_max_waiting",
            "Configured bound of the waiting queue.",
            ("model",),
            registry=r,
        )
        self._running = self.running.labels(model)
        self._waiting = self.waiting.labels(model)
        self._kv = self.kv_usage.labels(model)
        self._batch = self.batch_size.labels(model)
        self._step = self.step_time.labels(model)
        self._decode_per_seq = self.decode_per_sequence.labels(model)
        self._preempt = self.preemptions.labels(model)
        self.max_waiting.labels(model).set(max_waiting)

    def _add_prefix_cache_counters(self) -> None:
        """Prompt tokens looked up in the prefix cache and those found there (vLLM's
        prefix_cache_queries / prefix_cache_hits, whose twins these are)."""
        r, model = self.registry, self.model
        self.prefix_cache_queries = Counter(
            "moeserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, counted when a request is admitted.",
            ("model",),
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "moeserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (full blocks), of those queried.",
            ("model",),
            registry=r,
        )
        self._pc_queries = self.prefix_cache_queries.labels(model)
        self._pc_hits = self.prefix_cache_hits.labels(model)
        self.vllm_prefix_cache = VllmPrefixCacheCounters(r, model)

    def _add_structured_output_instruments(self) -> None:
        """Grammar-constrained requests by kind, and grammar compile times."""
        r, model = self.registry, self.model
        self.structured_requests = Counter(
            "moeserve_structured_requests",
            "Requests constrained by a grammar (structured outputs), by kind.",
            ("model", "kind"),
            registry=r,
        )
        self.grammar_compile = _histogram(
            r,
            "moeserve_grammar_compile_seconds",
            "Time compiling a constrained request's grammar (cache: hit or miss).",
            ("model", "cache"),
            GRAMMAR_COMPILE_BUCKETS,
        )
        self._structured = {k: self.structured_requests.labels(model, k) for k in STRUCTURED_KINDS}
        self._compile = {c: self.grammar_compile.labels(model, c) for c in GRAMMAR_CACHE}

    def _add_spec_decode_counters(self) -> None:
        """Speculative decoding, with vLLM's meanings (vllm:spec_decode_*): drafts verified
        (one per sequence and step), their tokens, those accepted, and accepted ones by draft
        position (0: the first draft token; a series per position, created as seen)."""
        r, model = self.registry, self.model
        self.spec_drafts = Counter(
            "moeserve_spec_decode_num_drafts",
            "Speculative drafts verified (one per sequence and step).",
            ("model",),
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "moeserve_spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            ("model",),
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "moeserve_spec_decode_num_accepted_tokens",
            "Draft tokens accepted (the bonus or replacement token is not counted).",
            ("model",),
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            "moeserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ("model", "position"),
            registry=r,
        )
        self._spec_drafts = self.spec_drafts.labels(model)
        self._spec_draft_tokens = self.spec_draft_tokens.labels(model)
        self._spec_accepted = self.spec_accepted_tokens.labels(model)
        self._spec_per_pos: list[Any] = []

    def _observe_spec_decode(self, step: Any) -> None:
        self._spec_drafts.inc(step.spec_num_drafts)
        self._spec_draft_tokens.inc(step.spec_num_draft_tokens)
        self._spec_accepted.inc(step.spec_num_accepted_tokens)
        per_pos = step.spec_accepted_per_pos
        while len(self._spec_per_pos) < len(per_pos):  # k is at most 32: bounded series
            position = str(len(self._spec_per_pos))
            self._spec_per_pos.append(self.spec_accepted_per_pos.labels(self.model, position))
        for child, count in zip(self._spec_per_pos, per_pos):
            if count:
                child.inc(count)

    def _add_model_instruments(
        self, info: dict[str, str], weight_bytes: int, kv_cache_bytes: int
    ) -> None:
        """The served model's numeric formats (an info gauge) and its resident bytes."""
        r, model = self.registry, self.model
        self.model_info = Gauge(
            "moeserve_model_info",
            "The served model's numeric formats (value 1): weights and KV cache.",
            ("model", *sorted(info)),
            registry=r,
        )
        self.model_info.labels(model, *(info[k] for k in sorted(info))).set(1)
        self.memory = Gauge(
            "moeserve_model_memory_bytes",
            "Bytes resident for the model: weights (8-bit weights with their scales) and "
            "the KV cache.",
            ("model", "kind"),
            registry=r,
        )
        self.memory.labels(model, "weights").set(weight_bytes)
        self.memory.labels(model, "kv_cache").set(kv_cache_bytes)

    # ------------------------------------------------------------------ engine steps

    def observe_step(self, step: Any) -> None:
        """Record one `StepStats`-like step (runs every engine step: kept cheap)."""
        self._running.set(step.num_running)
        self._waiting.set(step.num_waiting)
        self._kv.set(step.kv_usage)
        self.vllm.observe(step.num_running, step.num_waiting, step.kv_usage)
        self._batch.observe(step.batch_size)
        self._step.observe(step.duration_s)
        if step.batch_size and not step.num_prefill_tokens:
            self._decode_per_seq.observe(step.duration_s / step.batch_size)
        if step.num_preemptions:
            self._preempt.inc(step.num_preemptions)
        if step.prefix_cache_queries:
            self._pc_queries.inc(step.prefix_cache_queries)
            self._pc_hits.inc(step.prefix_cache_hits)
            self.vllm_prefix_cache.observe(step.prefix_cache_queries, step.prefix_cache_hits)
        if step.expert_tokens is not None:
            self.experts.observe(step.expert_tokens)
        if getattr(step, "spec_num_drafts", 0):
            self._observe_spec_decode(step)

    # ------------------------------------------------------------------ requests

    def observe_request(
        self,
        api: str,
        times: Any,
        num_prompt_tokens: int,
        num_output_tokens: int,
        finish_reason: str | None,
        status: str = "ok",
        trace_id: str | None = None,
        key: str = NO_KEY,
    ) -> RequestLatencies:
        """Record a request the engine finished (or aborted): latency histograms (with a
        {"trace_id"} exemplar when given), token counters and requests_total. Returns the
        latencies so the caller can log them."""
        api = _api(api)
        lat = request_latencies(times, num_output_tokens)
        exemplar = {"trace_id": trace_id} if trace_id else None
        if lat.queue is not None:
            self._queue.observe(max(lat.queue, 0.0))
        scheduled, first, end = times.first_scheduled, times.first_token, times.finished
        if scheduled is not None and first is not None:
            self._prefill.observe(max(first - scheduled, 0.0))
        if first is not None and end is not None:
            self._decode.observe(max(end - first, 0.0))
        self._context["prompt"].observe(num_prompt_tokens)
        self._context["total"].observe(num_prompt_tokens + num_output_tokens)
        if lat.ttft is not None:
            self._ttft[api].observe(max(lat.ttft, 0.0), exemplar)
        if lat.tpot is not None:
            self._tpot[api].observe(max(lat.tpot, 0.0), exemplar)
        if lat.e2e is not None:
            self._e2e[api].observe(max(lat.e2e, 0.0), exemplar)
        if num_prompt_tokens > 0:
            self._prompt[api].inc(num_prompt_tokens)
        if num_output_tokens > 0:
            self._generated[api].inc(num_output_tokens)
        self.count_request(api, status, finish_reason, key)
        return lat

    def count_request(
        self, api: str, status: str, finish_reason: str | None = None, key: str = NO_KEY
    ) -> None:
        """requests_total += 1. Unknown status/finish_reason values map to bounded ones
        (server_error, none); an unknown api raises ValueError. `key` is an API key's name
        or a fixed label: the caller bounds it (service/api_keys.py)."""
        status = status if status in STATUSES else "server_error"
        reason = finish_reason if finish_reason in FINISH_REASONS else "none"
        labels = (_api(api), status, reason, key)
        child = self._requests.get(labels)
        if child is None:
            self.add_key(key)
            child = self._requests[labels]
        child.inc()

    def add_key(self, key: str, limits: Iterable[str] = ()) -> None:
        """Exports requests_total for API key name `key` (and rate_limited_total for each of
        its `limits`) from now on, at 0 where new; idempotent (keys-file reloads)."""
        model = self.model
        for api in APIS:
            for status in STATUSES:
                for reason in FINISH_REASONS:
                    labels = (api, status, reason, key)
                    if labels not in self._requests:
                        self._requests[labels] = self.requests.labels(model, *labels)
            for limit in limits:
                if (api, key, limit) not in self._rate_limited:
                    self._rate_limited[(api, key, limit)] = self.rate_limited.labels(
                        model, api, key, limit
                    )

    def count_rate_limited(self, api: str, key: str, limit: str) -> None:
        """rate_limited_total{key, limit} += 1: a request refused for its key's `limit`."""
        child = self._rate_limited.get((_api(api), key, limit))
        if child is None:
            self.add_key(key, (limit,))
            child = self._rate_limited[(api, key, limit)]
        child.inc()

    def count_structured(self, kind: str) -> None:
        """structured_requests_total{kind} += 1, for a request constrained by a grammar
        (kind: one of STRUCTURED_KINDS; another raises ValueError, as an unknown api does)."""
        counter = self._structured.get(kind)
        if counter is None:  # a wiring bug, not runtime data
            raise ValueError(f"kind must be one of {STRUCTURED_KINDS}, got {kind!r}")
        counter.inc()

    def observe_grammar_compile(self, seconds: float, cache_hit: bool | None) -> None:
        """One grammar compile (RequestTimes.grammar_compile_s / grammar_cache_hit)."""
        self._compile["hit" if cache_hit else "miss"].observe(max(seconds, 0.0))

    def count_rejected(self, api: str) -> None:
        """A request refused because the waiting queue is full (429 / RESOURCE_EXHAUSTED)."""
        self.count_request(api, "rejected", None)

    def set_max_waiting(self, max_waiting: int) -> None:
        self.max_waiting.labels(self.model).set(max_waiting)


def _histogram(
    registry: CollectorRegistry,
    name: str,
    doc: str,
    labels: Sequence[str],
    buckets: Sequence[float],
) -> Histogram:
    return Histogram(name, doc, labels, registry=registry, buckets=buckets)


def _api(api: str) -> str:
    if api not in APIS:  # a wiring bug, not runtime data: fail loudly in tests
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    return api


def render_metrics(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """(body, content type) for GET /metrics: Prometheus text by default, OpenMetrics with
    exemplars when `accept` (the Accept header) asks for application/openmetrics-text."""
    encoder, content_type = choose_encoder(accept or "")
    if isinstance(encoder, partial) and encoder.keywords.get("escaping") == UNDERSCORES:
        # prometheus_client (0.26) writes OpenMetrics sample names in the label-name alphabet
        # under underscores escaping: vllm:num_requests_running became vllm_num_requests_running
        # beside HELP and TYPE lines naming vllm:num_requests_running. Every name here is in the
        # legacy alphabet, which that escaping leaves as it is: written unescaped.
        encoder = partial(encoder.func, **{**encoder.keywords, "escaping": ALLOWUTF8})
    return encoder(registry), content_type
