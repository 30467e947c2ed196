"""Prompt validation against the model's limits, shared by LLMEngine and the API process's
AsyncLLMEngine (which rejects a bad request before it crosses to the engine core)."""

from __future__ import annotations

from inference.errors import InvalidParameterError
from inference.sampling_params import SamplingParams

Prompt = str | list[int]

# A text this many characters per context position long is first tokenized by its head
# alone: tokenizing all of a 1 MB prompt takes the API process most of a second (a hostile
# client's cheapest way to stall every other request). English runs ~4 characters a token.
HEAD_CHARS_PER_TOKEN = 8
# tokens the cut can add at the head's end (its last word split differently), so that a
# head over max_model_len + HEAD_MARGIN proves the whole prompt over max_model_len
HEAD_MARGIN = 64


def tokenize_prompt(
    tokenizer, vocab_size: int, max_model_len: int, prompt: Prompt, params: SamplingParams
) -> list[int]:
    """Validates a prompt (text or token ids) and its max_tokens; returns the token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameterError("prompt", "must not be empty")
        ids = encode_within(tokenizer, prompt, max_model_len)
    elif isinstance(prompt, list) and len(prompt) >= max_model_len:
        # before reading every element: a client can send hundreds of thousands
        raise InvalidParameterError(
            "prompt", f"has {len(prompt)} tokens; the maximum context length is {max_model_len}"
        )
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


def encode_within(tokenizer, text: str, max_model_len: int | None, **kwargs) -> list[int]:
    """tokenizer.encode(text, **kwargs), except that a long text whose head alone is over
    max_model_len tokens is refused (InvalidParameterError on the prompt) before the rest is
    tokenized. None: no limit (the tokenize endpoints)."""
    head = (max_model_len or 0) * HEAD_CHARS_PER_TOKEN
    if max_model_len is not None and len(text) > head:
        n = len(tokenizer.encode(text[:head], **kwargs))
        if n >= max_model_len + HEAD_MARGIN:
            raise InvalidParameterError(
                "prompt",
                f"has over {n - HEAD_MARGIN} tokens in its first {head} characters alone; "
                f"the maximum context length is {max_model_len}",
            )
    return tokenizer.encode(text, **kwargs)


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
