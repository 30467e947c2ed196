"""vLLM's --hf-overrides: config.json fields replaced at load. Its use here is a RoPE scaling
that stretches a checkpoint's context, as vLLM's recipe does: SmolLM2 ships 8,192 positions
and no scaling, and {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 8192}} serves it 32,768 (models/args.py derives the
context length from the scaling as vLLM does).

rope_scaling (the name before transformers 5) merges into rope_parameters, the checkpoint's
rope_theta kept; a YaRN scaling without original_max_position_embeddings takes the
checkpoint's max_position_embeddings. Any other dict merges into a dict field; anything
else replaces the field."""

from __future__ import annotations

import json
from typing import Any

from inference.errors import InvalidParameterError

NAME = "hf_overrides"


def hf_overrides(value: str | dict | None) -> dict[str, Any]:
    """JSON text or a dict -> the overrides ({} for None); InvalidParameterError naming
    hf_overrides for text that is not a JSON object."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(NAME, f"is not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(NAME, "must be a JSON object of config.json fields")
    rope = value.get("rope_scaling", {})
    if not isinstance(rope, dict):
        raise InvalidParameterError(NAME, "rope_scaling must be an object")
    return value


def apply_hf_overrides(cfg, overrides: dict[str, Any]) -> None:
    """Replaces the transformers config's fields in place; a RoPE scaling is checked with
    transformers' own validation (InvalidParameterError naming the key)."""
    for key, value in overrides.items():
        if key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
            rope = dict(getattr(cfg, "rope_parameters", None) or {}) | value
            if "type" in rope:  # the old name of rope_type
                rope.setdefault("rope_type", rope.pop("type"))
            if rope.get("rope_type") == "yarn":
                rope.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
            cfg.rope_parameters = rope
            try:
                cfg.validate_rope()
            except (KeyError, ValueError, TypeError) as exc:
                raise InvalidParameterError(NAME, f"{key}: {exc}") from None
        elif isinstance(value, dict) and isinstance(getattr(cfg, key, None), dict):
            setattr(cfg, key, getattr(cfg, key) | value)
        else:
            setattr(cfg, key, value)
