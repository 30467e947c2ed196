"""The inspector API's bodies (msgspec Structs; the OpenAPI document's components)."""

from __future__ import annotations

from typing import Literal

import msgspec

from service.responses import RequestMetrics

Outcome = Literal["in_progress", "ok", "error", "aborted", "rejected"]
Filter = Literal["all", "errors", "aborts", "rejected", "slow"]


class _Body(msgspec.Struct, kw_only=True):
    pass


class InspectorRequest(_Body, kw_only=True):
    """One recorded request. Times in milliseconds; None where it never got that far."""

    id: str  # the inspector's id (/inspect/api/requests/{id})
    request_id: str  # x-request-id / GenerateRequest.request_id
    response_id: str | None  # the engine's id (OpenAI's `id`), once admitted
    api: Literal["rest", "grpc"]
    key: str  # the API key's name ("none": no key required; "unauthenticated": refused)
    operation: str | None  # "chat" | "text_completion"; None when refused before parsing
    stream: bool | None
    started_at: float  # Unix seconds
    outcome: Outcome
    status: str | None  # moeserve_requests_total's status label, once finished
    code: str | None  # HTTP status ("200", "429", "499": the client left) or gRPC code name
    error: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    preemptions: int
    trace_id: str | None
    slow: bool  # e2e over the p95 of the recorded requests
    # speculative decoding: draft tokens verified for it, and those accepted (0: no drafts)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class InspectorRequestList(_Body, kw_only=True):
    requests: list[InspectorRequest]  # newest first
    capacity: int  # --inspector-requests
    recorded: int  # requests seen since start-up
    slow_threshold_ms: float | None  # current p95 of e2e (the "slow" filter)


class InspectorPhase(_Body, kw_only=True):
    name: Literal["queue", "prefill", "decode"]
    start_ms: float  # from the request's arrival in the engine
    end_ms: float


class InspectorPeer(_Body, kw_only=True):
    response_id: str  # the engine's id of another request in the step
    id: str | None  # its inspector id while it is still recorded


class InspectorStep(_Body, kw_only=True):
    index: int  # the engine step's number since start-up
    at_ms: float  # its start, from the request's arrival
    duration_ms: float
    phase: Literal["prefill", "decode"]  # what the step did for this request
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    kv_usage: float
    others: list[InspectorPeer]  # other requests in the step (the first few)
    others_count: int


class InspectorRequestDetail(_Body, kw_only=True):
    request: InspectorRequest
    phases: list[InspectorPhase]
    first_token_ms: float | None
    steps: list[InspectorStep]  # the first and the last steps it was in
    steps_omitted: int  # steps in between that were not kept
    logs: list[str]  # its JSON log lines, by time
    trace_url: str | None  # --trace-url-template with its trace id
    prompt: str | None  # only with --log-prompts
    outputs: list[str] | None  # one per choice; only with --log-prompts
    # once finished: the timings an `include_metrics` response carries (the same numbers)
    metrics: RequestMetrics | None = None


class InspectorSeries(_Body, kw_only=True):
    """Per-second series of the last minutes, oldest first (sparklines)."""

    start: float  # Unix second of the first point
    step_ms: list[float | None]  # mean step time (None: no step that second)
    tokens_per_s: list[int]  # generated tokens
    prefill_tokens_per_s: list[int]
    batch_size: list[float | None]  # mean sequences per step


class InspectorHotExpert(_Body, kw_only=True):
    expert: int
    tokens: int  # routed to it in the window


class InspectorExpertLayer(_Body, kw_only=True):
    """One MoE layer's load in the window: what stays readable at 256+ experts."""

    layer: int  # the MoE layer's index (the `layer` label of the expert metrics)
    tokens: int  # routed in this layer (each token counts top_k times)
    imbalance: float  # busiest expert / mean expert load (0: nothing routed)
    top: list[InspectorHotExpert]  # the busiest experts, busiest first (none idle)


class InspectorExperts(_Body, kw_only=True):
    window_s: int
    num_experts: int  # routed experts per MoE layer
    tokens: list[list[int]]  # [MoE layer][expert] tokens routed in the window: every expert
    layers: list[InspectorExpertLayer]


class InspectorEngine(_Body, kw_only=True):
    model: str
    instance: str | None  # this replica's service.instance.id (telemetry/instance.py)
    running: int
    waiting: int
    in_flight: int
    kv_usage: float
    kv_blocks_used: int
    steps: int  # engine steps since start-up
    series: InspectorSeries
    experts: InspectorExperts | None  # None for a dense model
