"""What a request must satisfy before the engine sees it, written once for both APIs: the
request id, the model name, the prompt or messages (tokenized off the event loop), the
sampling fields. A broken rule is a BadRequest naming the field (HTTP 400 with `param`,
gRPC INVALID_ARGUMENT); length and vocabulary limits stay with the engine.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass

import jinja2
import msgspec

from inference import InvalidParameterError, SamplingParams
from inference.prompts import encode_within
from service.errors import BadRequest, NotFound
from service.harmony_prompt import is_harmony_tokenizer, render_harmony

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_FIELD_PATH = re.compile(r"at `\$\.([^`]+)`")  # `$.messages[0].role` -> messages[0].role
_KEY_PATH = re.compile(r"at `key` in `\$\.([^`]+)`")  # a dict's key: the dict's path
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """A generation request as both APIs parse it: the prompt as token ids and how to sample."""

    prompt_ids: list[int]
    params: SamplingParams
    operation: str  # the GenAI operation: "chat" or "text_completion"
    stream: bool
    # the API's name of the field params.structured_outputs came from, for its errors
    constraint_field: str | None = None
    include_metrics: bool = False  # the response carries the request's timings


def request_id(given: str | None, fresh_prefix: str = "") -> str:
    """The caller's request id (header `x-request-id`, field `request_id`) when it has one, a
    fresh one otherwise; an id that is not 1-128 of [A-Za-z0-9._:-] is refused, on both APIs."""
    if not given:
        return fresh_prefix + uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise BadRequest(
            "request_id must be 1-128 characters of A-Z a-z 0-9 . _ : -", param="request_id"
        )
    return given


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> msgspec.Struct:
    """A JSON body as the route's schema says, strictly (a JSON "5" is not the integer 5, as
    the OpenAPI document promises); malformed, mistyped or too deeply nested: BadRequest."""
    try:
        try:
            return msgspec.json.decode(body or b"null", type=schema)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            # JSON (and the OpenAPI document) counts 5.0 as an integer; msgspec does not
            return msgspec.convert(_integral(msgspec.json.decode(body)), schema)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except msgspec.ValidationError as exc:
        if str(exc) == "Expected `object`, got `null`":
            raise BadRequest("request body is required (a JSON object)") from None
        raise _field_error(exc, None) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def _field_error(exc: msgspec.ValidationError, fallback: str | None) -> BadRequest:
    """A msgspec validation error as a BadRequest naming the field: an unknown one, the path
    of a mistyped or out-of-range value (`messages[0].role`), a missing one, else `fallback`."""
    cause = exc.__cause__
    if isinstance(cause, InvalidParameterError):  # a SamplingParams rule across fields
        return BadRequest(str(cause), param=cause.param)
    text = str(exc)
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        return BadRequest(text, param=unknown.group(1))
    path = _FIELD_PATH.search(text) or _KEY_PATH.search(text)
    if path:
        return BadRequest(f"{path.group(1)}: {text.split(' - at ')[0]}", param=path.group(1))
    missing = text.partition("missing required field `")[2].rstrip("`")
    return BadRequest(text, param=missing or fallback)


def _integral(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def check_model(served: str, model: str | None) -> None:
    if model is not None and model != served:
        raise NotFound(
            f"The model `{model}` does not exist. Served: `{served}`.",
            param="model",
            code="model_not_found",
        )


def sampling_params(**fields) -> SamplingParams:
    """API fields -> SamplingParams; None takes the engine's default. Type and range errors
    name the field."""
    values = {k: v for k, v in fields.items() if v is not None}
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise _field_error(exc, "params") from None


async def text_ids(
    tokenizer, text: str, limit: int | None, add_special_tokens: bool = True
) -> list[int]:
    """`limit`: the context length a generation must fit (a prompt far over it is refused
    by its head alone: encode_within); None for the tokenize endpoints."""
    if not text:
        raise BadRequest("prompt must not be empty", param="prompt")
    return await asyncio.to_thread(_encode, tokenizer, text, limit, add_special_tokens)


def _encode(tokenizer, text: str, limit: int | None, add_special_tokens: bool) -> list[int]:
    try:
        return encode_within(tokenizer, text, limit, add_special_tokens=add_special_tokens)
    except InvalidParameterError as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def token_ids(prompt: list) -> list[int]:
    """A prompt given as token ids."""
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
    return prompt


async def chat_ids(
    tokenizer,
    messages: list[dict],
    limit: int | None,
    add_generation_prompt: bool = True,
    tools: list | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """messages ({role, content, name?, tool_calls?, tool_call_id?}) and the tools on offer
    through the model's chat template -> token ids (`limit`: as text_ids).
    `continue_final_message`: vLLM's, the last message left open for the model to go on."""
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    if continue_final_message:
        _check_continuation(messages, add_generation_prompt)
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
    if is_harmony_tokenizer(tokenizer):  # gpt-oss: harmony's renderer, as vLLM's
        if continue_final_message:  # harmony's renderer always opens a new message
            raise BadRequest(
                "continue_final_message is not supported with harmony (gpt-oss) prompts",
                param="continue_final_message",
            )
        return await asyncio.to_thread(render_harmony, messages, tools)
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template; send a plain prompt instead",
            param="messages",
            code="no_chat_template",
        )
    return await asyncio.to_thread(
        _render_chat,
        tokenizer,
        messages,
        add_generation_prompt,
        tools,
        limit,
        continue_final_message,
    )


def _check_continuation(messages: list[dict], add_generation_prompt: bool) -> None:
    """vLLM's rules for continue_final_message: no new turn opened, an assistant's to go on."""
    if add_generation_prompt:
        raise BadRequest(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if messages[-1].get("role") != "assistant":
        raise BadRequest(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )


def _render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    tools,
    limit: int | None,
    continue_final_message: bool = False,
) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools,
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:  # raise_exception() too
        raise BadRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    # The template already wrote any special tokens it wants (vLLM does the same).
    # "prompt", as the engine names a rendered chat over the context
    return _encode(tokenizer, text, limit, False)


def one_of(first: tuple[str, object], second: tuple[str, object]) -> None:
    """Exactly one of two alternatives (prompt / messages) must be given."""
    (a, va), (b, vb) = first, second
    if bool(va) == bool(vb):
        both = "both are" if va else "neither is"
        raise BadRequest(f"give exactly one of {a} and {b} ({both} set)", param=a)
