"""vLLM's render routes: POST /v1/chat/completions/render and /v1/completions/render take the
body of the generation route they are named after and answer vLLM's GenerateRequest (the
prompt's token ids and the sampling parameters) without generating anything.

Who calls them: vLLM's router under kv_aware asks every replica to render a request before
choosing one (falling back to /tokenize where a replica answers 404), and llm-d's precise
prefix scorer renders through them; both hash the token ids into blocks and look them up
among the replicas' KV-cache events. The ids come from the same function the generation
route runs (openai_inputs.py), so they are the ones the engine caches. vLLM serves render
over REST only (its FastAPI routes); our gRPC API has no render either.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, post

from inference import InvalidParameterError, SamplingParams
from service.auth import reject_while_draining, require_api_key
from service.controllers.common import serving_state
from service.controllers.openai_inputs import chat_input, completion_input
from service.errors import from_engine_error
from service.openapi_errors import errors
from service.responses import GenerateRequest
from service.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions

# ours, not vLLM's SamplingParams: where the reasoning ends is our structured-output detail
_INTERNAL = ("reasoning_end",)


def vllm_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters under vLLM's SamplingParams names (the same names and
    meanings; top_k 0 is vLLM's "all tokens" too)."""
    out = msgspec.to_builtins(params)
    for name in _INTERNAL:
        out.pop(name, None)
    return out


def _admissible(request: Request, ids: list[int], params: SamplingParams, field: str | None):
    """What the engine checks when the generation is added (the prompt and max_tokens within
    the context, token ids in the vocabulary): render refuses what the generation would."""
    try:
        serving_state(request).engine.tokenize_prompt(ids, params)
    except InvalidParameterError as exc:
        raise from_engine_error(exc, field) from None


def _rendered(
    prefix: str,
    ids: list[int],
    params: SamplingParams,
    model: str | None,
    stream: bool,
    options: StreamOptions | None,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        token_ids=ids,
        sampling_params=vllm_sampling_params(params),
        model=model,
        stream=stream,
        stream_options=msgspec.to_builtins(options) if stream and options else None,
    )


class RenderController(Controller):
    path = "/v1"
    tags = ("Render",)
    guards = (require_api_key, reject_while_draining)

    @post(
        "/chat/completions/render",
        operation_id="renderChatCompletion",
        status_code=200,
        responses=errors(400, 401, 404, 413, 503),
    )
    async def render_chat_completion(
        self, request: Request, data: ChatCompletionRequest
    ) -> GenerateRequest:
        """vLLM's: a chat completion body rendered through the chat template into the token
        ids and sampling parameters its generation would run on; nothing is generated."""
        given = await chat_input(serving_state(request), data)
        _admissible(request, given.ids, given.params, given.constraint_field)
        return _rendered(
            "chatcmpl", given.ids, given.params, data.model, data.stream, data.stream_options
        )

    @post(
        "/completions/render",
        operation_id="renderCompletion",
        status_code=200,
        responses=errors(400, 401, 404, 413, 503),
    )
    async def render_completion(
        self, request: Request, data: CompletionRequest
    ) -> list[GenerateRequest]:
        """vLLM's: a completion body rendered into the token ids and sampling parameters its
        generation would run on, one per prompt (this server takes one prompt a request)."""
        given = await completion_input(serving_state(request), data)
        _admissible(request, given.ids, given.params, given.constraint_field)
        rendered = _rendered(
            "cmpl", given.ids, given.params, data.model, data.stream, data.stream_options
        )
        return [rendered]
