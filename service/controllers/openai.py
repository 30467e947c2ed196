"""OpenAI-compatible /v1 routes: completions, chat completions (JSON or SSE), models.

Each route parses its body (openai_inputs.py, shared with vLLM's render routes) into a
validation.GenerationInput and hands it with a renderer to
`_respond`, which runs the request's service.generation.Generation and answers with the whole
response or its SSE chunks (service/controllers/openai_render.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from service.auth import reject_while_draining, require_api_key
from service.controllers.common import (
    cancel_on_disconnect,
    generation,
    generation_lifecycle,
    serving_state,
)
from service.controllers.openai_inputs import chat_input, completion_input
from service.controllers.openai_render import ChatRender, CompletionRender
from service.errors import ServiceError
from service.generation import Generation
from service.openapi_errors import errors
from service.prompt_scoring import echo_text
from service.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from service.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from service.validation import GenerationInput

_encode = msgspec.json.Encoder().encode
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _generation_route(path: str, operation_id: str, response: type, id_prefix: str):
    """A generation route: JSON or SSE, run inside its Generation (generation_lifecycle)."""
    return post(
        path,
        operation_id=operation_id,
        status_code=200,
        responses={
            200: ResponseSpec(response, description="The response, or its SSE chunks"),
            **errors(400, 401, 404, 413, 429, 503),
        },
        middleware=[generation_lifecycle(id_prefix)],
    )


def _sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def _respond(
    request: Request,
    gen: Generation,
    spec: GenerationInput,
    options: StreamOptions | None,
    render: CompletionRender | ChatRender,
) -> Response | Stream:
    """The whole response, or SSE chunks with the usage at the end (`include_usage`) or on
    every chunk too (vLLM's `continuous_usage_stats`). With `include_metrics` the response,
    or a stream's last chunk (with the usage), carries the request's timings. A stream waits
    for the first update before answering, so admission errors (429, 503, 400) become HTTP
    statuses before any SSE byte is sent."""
    if not spec.stream:
        final = await cancel_on_disconnect(request, gen.final(spec))
        body = render.whole(final)
        if spec.include_metrics:
            body.metrics = final.metrics()
        return Response(body)
    updates = gen.updates(spec)
    first = await cancel_on_disconnect(request, updates.__anext__())
    at_end = bool(options and options.include_usage) or spec.include_metrics
    every = bool(options and options.include_usage and options.continuous_usage_stats)

    async def body() -> AsyncIterator[bytes]:
        update = first
        try:
            while True:
                for chunk, usage in render.chunks(update):
                    yield _sse(render.chunk([chunk], usage if every else None))
                if update.finished:
                    break
                update = await updates.__anext__()
            if at_end:
                last = render.chunk([], update.usage)
                if spec.include_metrics:
                    last.metrics = update.metrics()
                yield _sse(last)
        except ServiceError as exc:  # e.g. the engine died mid-stream: tell the client
            yield _sse(exc.envelope())
        finally:
            await updates.aclose()  # client gone: the generation is aborted here
        yield b"data: [DONE]\n\n"

    return Stream(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


class OpenAIController(Controller):
    path = "/v1"
    tags = ("OpenAI",)
    guards = (require_api_key, reject_while_draining)

    @get("/models", operation_id="listModels", responses=errors(401, 503))
    async def list_models(self, request: Request) -> ModelList:
        """The served model."""
        state = serving_state(request)
        card = ModelCard(
            id=state.model_name,
            created=request.app.state.started_at,
            root=state.model_name,
            max_model_len=state.engine.max_model_len,
        )
        return ModelList(data=[card])

    @_generation_route("/completions", "createCompletion", CompletionResponse, "cmpl")
    async def create_completion(self, request: Request, data: CompletionRequest) -> Response:
        """Text completion (OpenAI `/v1/completions`), JSON or SSE."""
        state, gen = serving_state(request), generation(request)
        given = await completion_input(state, data)
        spec = GenerationInput(
            given.ids,
            given.params,
            "text_completion",
            data.stream,
            given.constraint_field,
            data.include_metrics,
        )
        echoed = echo_text(data.prompt, given.ids, state.engine.tokenizer) if data.echo else ""
        render = CompletionRender(
            request,
            gen.response_id,
            given.params.n,
            data.logprobs is not None,
            given.scoring,
            echoed,
        )
        return await _respond(request, gen, spec, data.stream_options, render)

    @_generation_route(
        "/chat/completions", "createChatCompletion", ChatCompletionResponse, "chatcmpl"
    )
    async def create_chat_completion(
        self, request: Request, data: ChatCompletionRequest
    ) -> Response:
        """Chat completion (OpenAI `/v1/chat/completions`) through the model's chat template."""
        state, gen = serving_state(request), generation(request)
        given = await chat_input(state, data)
        spec = GenerationInput(
            given.ids, given.params, "chat", data.stream, given.constraint_field,
            data.include_metrics,
        )  # fmt: skip
        render = ChatRender(
            request, gen.response_id, data.logprobs, given.plan, given.reasoning, given.specials
        )
        return await _respond(request, gen, spec, data.stream_options, render)
