"""OpenAI-compatible /v1 routes: completions, chat completions (JSON or SSE), models.

Each route parses its body into a validation.GenerationInput, runs it through the request's
service.generation.Generation and renders the updates as OpenAI's JSON or SSE chunks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from inference import CompletionOutput
from inference.outputs import TokenLogprobs
from service import validation
from service.auth import reject_while_draining, require_api_key
from service.controllers.common import (
    cancel_on_disconnect,
    generation,
    generation_lifecycle,
    serving_state,
)
from service.errors import BadRequest, ServiceError
from service.generation import Generation, Update
from service.openapi import errors
from service.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
    TopLogprob,
    Usage,
    chat_message_dicts,
    unsupported_fields,
)
from service.state import ServingState
from service.validation import GenerationInput

_encode = msgspec.json.Encoder().encode
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_SAMPLING = (
    "n",
    "seed",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
)


def _sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _usage(update: Update) -> Usage:
    u = update.usage
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
    )


def _sampling(data: Any, **fields: Any):
    bad = unsupported_fields(data)
    if bad:
        raise BadRequest(f"{bad[0]} is not supported by this server", param=bad[0])
    stop = [data.stop] if isinstance(data.stop, str) else data.stop
    return validation.sampling_params(
        stop=stop, **fields, **{n: getattr(data, n) for n in _SAMPLING}
    )


async def _completion_ids(state: ServingState, prompt: str | list[Any]) -> list[int]:
    """A string or a list of token ids; a one-element list of either is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await validation.text_ids(state.engine.tokenizer, prompt)
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(
            "a list of several prompts is not supported; send one request per prompt",
            param="prompt",
        )
    return validation.token_ids(prompt)


class _Render:
    """Runs one request's Generation and renders it: the whole response once, or SSE chunks
    with the usage at the end (`include_usage`) or on every chunk (vLLM's
    `continuous_usage_stats`)."""

    def __init__(self, request: Request, gen: Generation, spec: GenerationInput) -> None:
        self.request, self.gen, self.spec = request, gen, spec
        self.created = int(time.time())
        self.model = serving_state(request).model_name
        self.decode: Callable[[int], str] = request.app.state.token_text

    async def whole(self) -> Update:
        return await cancel_on_disconnect(self.request, self.gen.final(self.spec))

    async def stream(
        self,
        options: StreamOptions | None,
        chunks: Callable[[Update], list],
        with_usage: Callable[[Any, Usage | None], Any],
    ) -> Stream:
        """Waits for the first update before answering, so admission errors (429, 503, 400)
        become HTTP statuses before any SSE byte is sent."""
        updates = self.gen.updates(self.spec)
        first = await cancel_on_disconnect(self.request, updates.__anext__())
        at_end = bool(options and options.include_usage)
        every = at_end and bool(options and options.continuous_usage_stats)

        async def body() -> AsyncIterator[bytes]:
            update = first
            try:
                while True:
                    for chunk in chunks(update):
                        yield _sse(with_usage(chunk, _usage(update) if every else None))
                    if update.finished:
                        break
                    update = await updates.__anext__()
                if at_end:
                    yield _sse(with_usage(None, _usage(update)))
            except ServiceError as exc:  # e.g. the engine died mid-stream: tell the client
                yield _sse(
                    ErrorResponse(
                        error=ErrorBody(
                            message=exc.message, type=exc.error_type, param=exc.param, code=exc.code
                        )
                    )
                )
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
        return ModelList(
            data=[
                ModelCard(
                    id=state.model_name,
                    created=request.app.state.started_at,
                    root=state.model_name,
                    max_model_len=state.engine.max_model_len,
                )
            ]
        )

    @post(
        "/completions",
        operation_id="createCompletion",
        status_code=200,
        responses={
            200: ResponseSpec(CompletionResponse, description="The completion, or its SSE chunks"),
            **errors(400, 401, 404, 413, 429, 503),
        },
        middleware=[generation_lifecycle("cmpl")],
    )
    async def create_completion(self, request: Request, data: CompletionRequest) -> Response:
        """Text completion (OpenAI `/v1/completions`), JSON or SSE."""
        state, gen = serving_state(request), generation(request)
        validation.check_model(state.model_name, data.model)
        params = _sampling(
            data,
            max_tokens=data.max_tokens if data.max_tokens is not None else 16,
            logprobs=data.logprobs,
        )
        spec = GenerationInput(
            await _completion_ids(state, data.prompt), params, "text_completion", bool(data.stream)
        )
        render = _Render(request, gen, spec)
        offsets = [0] * params.n

        def logprobs(
            c: CompletionOutput, entries: list[TokenLogprobs]
        ) -> CompletionLogprobs | None:
            if data.logprobs is None:
                return None
            tokens = [render.decode(e.token_id) for e in entries]
            text_offset = []
            for t in tokens:
                text_offset.append(offsets[c.index])
                offsets[c.index] += len(t)
            return CompletionLogprobs(
                tokens=tokens,
                token_logprobs=[e.logprob for e in entries],
                top_logprobs=[
                    {render.decode(t.token_id): t.logprob for t in e.top} for e in entries
                ],
                text_offset=text_offset,
            )

        def response(choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
            return CompletionResponse(
                id=gen.response_id,
                created=render.created,
                model=render.model,
                choices=choices,
                usage=usage,
            )

        if not data.stream:
            final = await render.whole()
            return Response(
                response(
                    [
                        CompletionChoice(
                            index=c.index,
                            text=c.text,
                            logprobs=logprobs(c, c.logprobs or []),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        for c in final.output.outputs
                    ],
                    _usage(final),
                )
            )

        def chunks(update: Update) -> list[CompletionChoice]:
            return [
                CompletionChoice(
                    index=c.index,
                    text=c.delta_text,
                    logprobs=logprobs(c, c.delta_logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in update.choices
            ]

        return await render.stream(
            data.stream_options,
            chunks,
            lambda choice, usage: response([choice] if choice else [], usage),
        )

    @post(
        "/chat/completions",
        operation_id="createChatCompletion",
        status_code=200,
        responses={
            200: ResponseSpec(ChatCompletionResponse, description="The reply, or its SSE chunks"),
            **errors(400, 401, 404, 413, 429, 503),
        },
        middleware=[generation_lifecycle("chatcmpl")],
    )
    async def create_chat_completion(
        self, request: Request, data: ChatCompletionRequest
    ) -> Response:
        """Chat completion (OpenAI `/v1/chat/completions`) through the model's chat template."""
        state, gen = serving_state(request), generation(request)
        validation.check_model(state.model_name, data.model)
        if data.top_logprobs is not None and not data.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        ids = await validation.chat_ids(state.engine.tokenizer, chat_message_dicts(data.messages))
        max_tokens = (
            data.max_completion_tokens
            if data.max_completion_tokens is not None
            else data.max_tokens
        )
        if max_tokens is None:  # OpenAI's default: up to the context length
            max_tokens = max(state.engine.max_model_len - len(ids), 1)
        params = _sampling(
            data,
            max_tokens=max_tokens,
            logprobs=(data.top_logprobs or 0) if data.logprobs else None,
        )
        render = _Render(request, gen, GenerationInput(ids, params, "chat", bool(data.stream)))

        def logprobs(entries: list[TokenLogprobs]) -> ChatLogprobs | None:
            if not data.logprobs:
                return None

            def top(token_id: int, lp: float) -> TopLogprob:
                text = render.decode(token_id)
                return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

            return ChatLogprobs(
                content=[
                    ChatTokenLogprob(
                        token=(t := top(e.token_id, e.logprob)).token,
                        logprob=t.logprob,
                        bytes=t.bytes,
                        top_logprobs=[top(x.token_id, x.logprob) for x in e.top],
                    )
                    for e in entries
                ]
            )

        def response(choices: list, usage: Usage | None, chunk: bool = False):
            kind = ChatCompletionChunk if chunk else ChatCompletionResponse
            return kind(
                id=gen.response_id,
                created=render.created,
                model=render.model,
                choices=choices,
                usage=usage,
            )

        if not data.stream:
            final = await render.whole()
            return Response(
                response(
                    [
                        ChatChoice(
                            index=c.index,
                            message=AssistantMessage(content=c.text),
                            logprobs=logprobs(c.logprobs or []),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        for c in final.output.outputs
                    ],
                    _usage(final),
                )
            )

        opened: set[int] = set()

        def chunks(update: Update) -> list[ChatChunkChoice]:
            new = {c.index: c for c in update.choices}
            result = []
            for index in (c.index for c in update.output.outputs):
                if index not in opened:  # OpenAI opens each choice with the role
                    opened.add(index)
                    result.append(
                        ChatChunkChoice(
                            index=index, delta=DeltaMessage(role="assistant", content="")
                        )
                    )
                c = new.get(index)
                if c is not None:
                    delta = DeltaMessage(content=c.delta_text) if c.delta_text else DeltaMessage()
                    result.append(
                        ChatChunkChoice(
                            index=index,
                            delta=delta,
                            logprobs=logprobs(c.delta_logprobs),
                            finish_reason=c.finish_reason,
                        )
                    )
            return result

        return await render.stream(
            data.stream_options,
            chunks,
            lambda choice, usage: response([choice] if choice else [], usage, chunk=True),
        )
