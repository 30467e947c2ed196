"""--speculative-config / LLMEngine(speculative_config=...): vLLM's SpeculativeConfig keys,
read from a JSON string or a dict; a bad value is an InvalidParameterError naming the key."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from inference.errors import InvalidParameterError

METHODS = ("ngram", "mtp")
# vLLM's former per-model MTP method names, which it still takes as "mtp" (with a warning)
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
MAX_SPECULATIVE_TOKENS = 32  # a step verifies k + 1 positions per sequence
# vLLM's default when neither lookup bound is given
DEFAULT_LOOKUP = 5
# Speculation stops while more sequences than this run: a step over that many rows is
# compute-bound on CPU, so verifying extra positions costs as much as it saves. vLLM's key;
# vLLM's default is None (never), ours is a small batch.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int


def _bad(message: str) -> InvalidParameterError:
    return InvalidParameterError("speculative_config", message)


def _int(given: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = given.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _bad(f"{key} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise _bad(f"{key} must be at most {high}, got {value}")
    return value


def speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The config, or None where speculation is off (no value, or an empty one)."""
    if value is None or value == "" or value == {}:
        return None
    given = value
    if isinstance(value, str):
        try:
            given = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _bad(f"is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise _bad("must be a JSON object")
    unknown = sorted(set(given) - set(_KEYS))
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
    method = given.get("method")
    if method in MTP_ALIASES:
        method = "mtp"
    if method not in METHODS:
        raise _bad(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    k = _int(given, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise _bad("num_speculative_tokens is required (1 to 32)")
    low = _int(given, "prompt_lookup_min", 1)
    high = _int(given, "prompt_lookup_max", 1)
    if method == "ngram":  # vLLM: one bound given stands for both; neither: 5
        low, high = low or high or DEFAULT_LOOKUP, high or low or DEFAULT_LOOKUP
        if low > high:
            raise _bad(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
    elif low is not None or high is not None:
        raise _bad("prompt_lookup_min / prompt_lookup_max are for method ngram only")
    batch = _int(given, "disable_by_batch_size", 1)
    return SpeculativeConfig(
        method,
        k,
        low or 0,
        high or 0,
        DEFAULT_DISABLE_BY_BATCH_SIZE if batch is None else batch,
    )


def mtp_layer_count(hf_config: Any) -> int:
    """The checkpoint's multi-token-prediction layers, as its config declares them
    (DeepSeek-V3 / GLM-4.5: num_nextn_predict_layers; MiniMax-M2: num_mtp_modules)."""
    for key in ("num_nextn_predict_layers", "num_mtp_modules"):
        count = getattr(hf_config, key, None)
        if isinstance(count, int) and count > 0:
            return count
    return 0


# the architectures whose MTP layer drafts (vLLM's deepseek_mtp and glm4_moe_mtp); vLLM has no
# MTP drafter for MiniMax-M2, whose config declares num_mtp_modules
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


def check_servable(
    config: SpeculativeConfig | None,
    hf_config: Any,
    model: str,
    tensor_names: Callable[[], Iterable[str]],
) -> None:
    """Refuses, at start-up, a method this checkpoint cannot serve: "mtp" needs the MTP layer
    in config.json (num_nextn_predict_layers) and its tensors in the checkpoint
    (model.layers.<num_hidden_layers>.*, read from `tensor_names()`), of an architecture
    that drafts with it."""
    if config is None or config.method != "mtp":
        return
    if not mtp_layer_count(hf_config):
        raise _bad(
            f"method 'mtp' needs a checkpoint with MTP layers (num_nextn_predict_layers > 0); "
            f"{model} has none"
        )
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in MTP_ARCHITECTURES:
        raise _bad(
            f"method 'mtp' drafts with the MTP layer of {', '.join(MTP_ARCHITECTURES)} "
            f"checkpoints (vLLM's deepseek_mtp, glm4_moe_mtp); {model} is {arch}"
        )
    prefix = f"model.layers.{hf_config.num_hidden_layers}."
    if not any(name.startswith(prefix) for name in tensor_names()):
        raise _bad(
            f"method 'mtp' needs the MTP layer's weights ({prefix}*): {model}'s config.json "
            f"declares num_nextn_predict_layers = {mtp_layer_count(hf_config)} but its "
            "checkpoint has none"
        )
