"""OpenAI-compatible response bodies (msgspec Structs), and those of the probes and errors."""

from __future__ import annotations

from typing import Any

import msgspec


class _Body(msgspec.Struct, kw_only=True):
    pass


class Usage(_Body, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RequestMetrics(_Body, kw_only=True):
    """vLLM's per-request `metrics` (--enable-per-request-metrics and `include_metrics`):
    telemetry.requests.per_request_metrics, from the timestamps the histograms observe."""

    time_to_first_token_ms: float | None
    generation_time_ms: float | None  # arrival in the engine to the request finishing
    queue_time_ms: float | None
    mean_itl_ms: float | None  # mean time per output token after the first
    tokens_per_second: float | None  # output tokens / generation_time


# absent from a body unless the request asked for it (`include_metrics`)
OptionalMetrics = RequestMetrics | msgspec.UnsetType


class CompletionLogprobs(_Body, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token (no context)
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class PromptLogprob(_Body, kw_only=True):
    """vLLM's Logprob, as its `prompt_logprobs` answer has them."""

    logprob: float
    rank: int | None  # 1: the most likely token
    decoded_token: str | None


class CompletionChoice(_Body, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # vLLM's `prompt_logprobs` (asked for): per prompt position, null for the first, else
    # {token id: its logprob} for the prompt's token and the top ones; absent unless asked
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(_Body, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: OptionalMetrics = msgspec.UNSET


class TopLogprob(_Body, kw_only=True):
    token: str
    logprob: float | None
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body, kw_only=True):
    content: list[ChatTokenLogprob] | None


class FunctionCallBody(_Body, kw_only=True):
    name: str
    arguments: str  # JSON text of an object


class ToolCallBody(_Body, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallBody


class AssistantMessage(_Body, kw_only=True, omit_defaults=True):
    role: str  # "assistant"
    content: str | None
    reasoning_content: str | None = None  # the model's reasoning, as vLLM's (absent: none)
    tool_calls: list[ToolCallBody] | None = None


class ChatChoice(_Body, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Body, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    metrics: OptionalMetrics = msgspec.UNSET


class FunctionDelta(_Body, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaBody(_Body, kw_only=True, omit_defaults=True):
    """A streamed tool call: id, type and name on its first delta, arguments after."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class DeltaMessage(_Body, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaBody] | None = None


class ChatChunkChoice(_Body, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Body, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: OptionalMetrics = msgspec.UNSET


class ModelCard(_Body, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "moeserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Body, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ---- vLLM's render endpoints ---------------------------------------------------------------
class GenerateRequest(_Body, kw_only=True):
    """vLLM's GenerateRequest, what /v1/chat/completions/render and /v1/completions/render
    answer: the prompt's token ids exactly as the generation would run them (what vLLM's
    router under kv_aware and llm-d's precise prefix scorer hash into blocks), and the
    sampling parameters under vLLM's SamplingParams names. Text only: `features` (multimodal
    placeholders) is always null here."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]  # vLLM's SamplingParams fields we have
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


# ---- tokenizer endpoints -----------------------------------------------------------------
class TokenizeResponse(_Body, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body, kw_only=True):
    prompt: str


# ---- errors and probes -------------------------------------------------------------------
class ErrorBody(_Body, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Body, kw_only=True):
    error: ErrorBody


class HealthResponse(_Body, kw_only=True):
    status: str
    engine_alive: bool


class StartupPhaseBody(_Body, kw_only=True):
    phase: str  # load_weights | quantize | pack | kv_cache_alloc | compile | warmup | ready
    seconds: float


class ReadyResponse(_Body, kw_only=True):
    # ready | draining | engine_dead; while the model loads, StartingApp answers 503 with
    # status "starting", `phase` (the one in progress) and `startup` (service/startup.py)
    status: str
    model: str
    num_running: int
    num_waiting: int
    in_flight: int
    kv_usage: float
    kv_blocks_used: int
    startup: list[StartupPhaseBody] = []  # this start's phases, in the order reached
