"""Configuration: the engine's limits, its device and dtype, and where it keeps built things
(the model's shape: models/args.py).

Each component copies the scalars it needs at construction (nano-vllm style); nothing
reads a config deep inside the hot path.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from inference.errors import InvalidParameterError
from inference.hf_overrides import hf_overrides
from inference.kv_events import kv_events_config
from inference.spec_decode.config import speculative_config

# weights (quantization/qweight.py); the last four, vLLM's names of a published checkpoint's
# own format, are served as published (and must be the checkpoint's)
PUBLISHED_FORMATS = ("gptq", "awq", "compressed-tensors", "mxfp4")
QUANTIZATIONS = ("none", "int8", "int4", "fp8", *PUBLISHED_FORMATS)
KV_CACHE_DTYPES = (
    "auto",
    "int8",
    "int4",
    "fp8_e4m3",
    "fp8_e5m2",
)  # the paged cache (models/paged_cache.py)


@dataclass(slots=True)
class EngineConfig:
    """The limits of SPEC section 3 (same names as the CLI flags)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # vLLM's: a prompt's chunk per step is at most this many tokens (0: the whole budget), so
    # a long prompt leaves the rest of a step's budget to streams decoding and to new arrivals
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # default: min(max_position_embeddings, kv cache)
    kv_cache_tokens: int | None = None  # CPU default 65536; GPU: sized from free memory
    kv_cache_bytes: int | None = None  # the same budget in bytes (instead of tokens)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8, int4, fp8_e4m3, fp8_e5m2
    quantization: str | None = None  # weights: none, int8, int4, fp8; None: as the checkpoint ships
    max_waiting: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # torch.compile the decode steps (pure decode batches; prefill steps stay eager). Compiles
    # at start-up (warm-up generations), so the first request does not pay for it.
    compile: bool = False
    # vLLM's --hf-overrides (JSON, or a dict): config.json fields replaced at load, e.g. a
    # RoPE scaling that stretches the context (inference/hf_overrides.py)
    hf_overrides: str | dict | None = None
    # vLLM's --kv-events-config (JSON): the engine core publishes KV-cache events
    # (inference/kv_events.py); None or disabled: nothing is recorded
    kv_events_config: str | None = None
    # vLLM's --speculative-config (JSON, or a dict): {"method": "ngram", "num_speculative_tokens":
    # k, "prompt_lookup_min": a, "prompt_lookup_max": b} (inference/spec_decode/config.py)
    speculative_config: str | dict | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise InvalidParameterError("long_prefill_token_threshold", "must be >= 0")
        for name in ("max_model_len", "kv_cache_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameterError(name, "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise InvalidParameterError(
                "kv_cache_bytes", "sizes the same cache as kv_cache_tokens: set one of them"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(
                "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}"
            )
        kv_events_config(self.kv_events_config)  # refuses a malformed one, naming the field
        hf_overrides(self.hf_overrides)  # the same
        speculative_config(self.speculative_config)  # the same, naming the key
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidParameterError(
                "quantization", f"must be one of {', '.join(QUANTIZATIONS)}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", "is cuda but no CUDA device is available")
    if device not in ("cpu", "cuda"):
        raise InvalidParameterError("device", "must be auto, cpu or cuda")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU the checkpoint's own dtype (float16 runs as bfloat16
    there, since CPU float16 matmuls are slow)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise InvalidParameterError("dtype", "must be auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    chosen = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    return torch.bfloat16 if chosen == torch.float16 else chosen


def cache_root() -> Path:
    """Where moeserve keeps what it builds or fetches once: demo checkpoints, tokenizers,
    wheels, compiled kernels (MOESERVE_CACHE_DIR, else ~/.cache/moeserve)."""
    return Path(os.environ.get("MOESERVE_CACHE_DIR") or Path.home() / ".cache" / "moeserve")
