"""Prompt validation against the model's limits, shared by LLMEngine and the API process's
AsyncLLMEngine (which rejects a bad request before it crosses to the engine core)."""

from __future__ import annotations

from inference.errors import InvalidParameterError
from inference.sampling_params import SamplingParams

Prompt = str | list[int]


def tokenize_prompt(
    tokenizer, vocab_size: int, max_model_len: int, prompt: Prompt, params: SamplingParams
) -> list[int]:
    """Validates a prompt (text or token ids) and its max_tokens; returns the token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameterError("prompt", "must not be empty")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        if any(t < 0 or t >= vocab_size for t in ids):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab_size})")
    else:
        raise InvalidParameterError("prompt", "must be a string or a list of token ids")
    if not ids:
        raise InvalidParameterError("prompt", "must not be empty")
    if len(ids) >= max_model_len:
        raise InvalidParameterError(
            "prompt", f"has {len(ids)} tokens; the maximum context length is {max_model_len}"
        )
    if len(ids) + params.max_tokens > max_model_len:
        raise InvalidParameterError(
            "max_tokens",
            f"{params.max_tokens} + {len(ids)} prompt tokens exceeds "
            f"the maximum context length {max_model_len}",
        )
    check_token_ids(params, vocab_size)
    return ids


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request names besides its prompt are in the model's vocabulary."""
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidParameterError(
            "stop_token_ids", f"must be below the vocabulary size {vocab_size}"
        )
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidParameterError(
            "logit_bias", f"token ids must be below the vocabulary size {vocab_size}"
        )
