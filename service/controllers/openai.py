"""OpenAI-compatible /v1 routes: completions, chat completions (JSON or SSE), models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from inference import CompletionOutput, RequestOutput, SamplingParams
from inference.outputs import TokenLogprobs
from service.auth import reject_while_draining, require_api_key
from service.controllers.common import (
    cancel_on_disconnect,
    chat_prompt_ids,
    check_model,
    sampling_params,
    serving_state,
    text_prompt_ids,
)
from service.errors import BadRequest, ServiceError
from service.observability import rest_generation_telemetry
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
    TopLogprob,
    Usage,
    unsupported_fields,
)
from service.state import ServingState

_encode = msgspec.json.Encoder().encode
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


class _Generation:
    """One generation request's shared plumbing: validation, admission, JSON or SSE."""

    def __init__(self, request: Request, state: ServingState, api: str, prefix: str) -> None:
        self.request, self.state, self.api = request, state, api
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.model_name
        self.decode: Callable[[int], str] = request.app.state.token_text

    async def start(
        self, prompt_ids: list[int], params: SamplingParams, stream: bool
    ) -> tuple[RequestOutput, AsyncIterator]:
        """Submits to the engine and waits for the first output, so admission errors (429,
        503, 400) become HTTP statuses before any SSE byte is sent. Log lines carry the
        x-request-id as request_id; the engine's id (the response id) rides along."""
        log_context = {"response_id": self.id}
        agen = self.state.generate(
            self.api, prompt_ids, params, self.id, log_context, stream=stream
        )
        first = await cancel_on_disconnect(self.request, agen.__anext__())
        return first, agen

    async def final(self, first: RequestOutput, agen: AsyncIterator) -> RequestOutput:
        async def drain() -> RequestOutput:
            out = first
            async for out in agen:
                pass
            return out

        if first.finished:
            await agen.aclose()
            return first
        return await cancel_on_disconnect(self.request, drain())

    def stream(
        self,
        first: RequestOutput,
        agen: AsyncIterator,
        include_usage: bool,
        chunks: Callable[[RequestOutput], list[msgspec.Struct]],
        usage_chunk: Callable[[Usage], msgspec.Struct],
    ) -> Stream:
        async def body() -> AsyncIterator[bytes]:
            out = first
            try:
                for chunk in chunks(out):
                    yield _sse(chunk)
                async for out in agen:
                    for chunk in chunks(out):
                        yield _sse(chunk)
                if include_usage:
                    yield _sse(usage_chunk(_usage(out)))
            except ServiceError as exc:  # e.g. the engine died mid-stream: tell the client
                yield _sse(
                    ErrorResponse(
                        error=ErrorBody(
                            message=exc.message, type=exc.error_type, param=exc.param, code=exc.code
                        )
                    )
                )
            finally:
                await agen.aclose()  # client gone: the generation is aborted here
            yield b"data: [DONE]\n\n"

        return Stream(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


def _reject_unsupported(data: msgspec.Struct) -> None:
    bad = unsupported_fields(data)
    if bad:
        raise BadRequest(f"{bad[0]} is not supported by this server", param=bad[0])


def _stop(stop: str | list[str] | None) -> list[str] | None:
    return [stop] if isinstance(stop, str) else stop


def _common_fields(data: Any) -> dict[str, Any]:
    names = (
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
    return {"stop": _stop(data.stop), **{name: getattr(data, name) for name in names}}


async def _completion_prompt(state: ServingState, prompt: str | list[Any]) -> list[int]:
    """A string or a list of token ids; a one-element list of either is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await text_prompt_ids(state, prompt)
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(
            "a list of several prompts is not supported; send one request per prompt",
            param="prompt",
        )
    raise BadRequest("prompt must be a string or a list of token ids", param="prompt")


class OpenAIController(Controller):
    path = "/v1"
    tags = ("OpenAI",)
    guards = (require_api_key, reject_while_draining)

    @get("/models", operation_id="listModels")
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
        middleware=[rest_generation_telemetry],
    )
    async def create_completion(self, request: Request, data: CompletionRequest) -> Response:
        """Text completion (OpenAI `/v1/completions`), JSON or SSE."""
        state = serving_state(request)
        check_model(state, data.model)
        _reject_unsupported(data)
        params = sampling_params(
            max_tokens=data.max_tokens if data.max_tokens is not None else 16,
            logprobs=data.logprobs,
            **_common_fields(data),
        )
        ids = await _completion_prompt(state, data.prompt)
        gen = _Generation(request, state, "openai.completions", "cmpl")
        first, agen = await gen.start(ids, params, bool(data.stream))
        want_logprobs = data.logprobs is not None
        offsets = [0] * params.n

        def logprobs(
            c: CompletionOutput, entries: list[TokenLogprobs]
        ) -> CompletionLogprobs | None:
            if not want_logprobs:
                return None
            tokens = [gen.decode(e.token_id) for e in entries]
            text_offset = []
            for t in tokens:
                text_offset.append(offsets[c.index])
                offsets[c.index] += len(t)
            return CompletionLogprobs(
                tokens=tokens,
                token_logprobs=[e.logprob for e in entries],
                top_logprobs=[{gen.decode(t.token_id): t.logprob for t in e.top} for e in entries],
                text_offset=text_offset,
            )

        if not data.stream:
            out = await gen.final(first, agen)
            choices = [
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=logprobs(c, c.logprobs or []),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in out.outputs
            ]
            return Response(
                CompletionResponse(
                    id=gen.id,
                    created=gen.created,
                    model=gen.model,
                    choices=choices,
                    usage=_usage(out),
                )
            )

        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        reported: set[int] = set()

        def chunks(out: RequestOutput) -> list[CompletionResponse]:
            result = []
            for c in out.outputs:
                if c.index in reported or not (
                    c.delta_text or c.delta_token_ids or c.finish_reason
                ):
                    continue
                if c.finish_reason:
                    reported.add(c.index)
                choice = CompletionChoice(
                    index=c.index,
                    text=c.delta_text,
                    logprobs=logprobs(c, c.delta_logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                result.append(
                    CompletionResponse(
                        id=gen.id, created=gen.created, model=gen.model, choices=[choice]
                    )
                )
            return result

        return gen.stream(
            first,
            agen,
            include_usage,
            chunks,
            lambda u: CompletionResponse(
                id=gen.id, created=gen.created, model=gen.model, choices=[], usage=u
            ),
        )

    @post(
        "/chat/completions",
        operation_id="createChatCompletion",
        status_code=200,
        middleware=[rest_generation_telemetry],
    )
    async def create_chat_completion(
        self, request: Request, data: ChatCompletionRequest
    ) -> Response:
        """Chat completion (OpenAI `/v1/chat/completions`) through the model's chat template."""
        state = serving_state(request)
        check_model(state, data.model)
        _reject_unsupported(data)
        if data.top_logprobs is not None and not data.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        ids = await chat_prompt_ids(state, data.messages)
        max_tokens = (
            data.max_completion_tokens
            if data.max_completion_tokens is not None
            else data.max_tokens
        )
        if max_tokens is None:  # OpenAI's default: up to the context length
            max_tokens = max(state.engine.max_model_len - len(ids), 1)
        params = sampling_params(
            max_tokens=max_tokens,
            logprobs=(data.top_logprobs or 0) if data.logprobs else None,
            **_common_fields(data),
        )
        gen = _Generation(request, state, "openai.chat", "chatcmpl")
        first, agen = await gen.start(ids, params, bool(data.stream))

        def logprobs(entries: list[TokenLogprobs]) -> ChatLogprobs | None:
            if not data.logprobs:
                return None

            def top(token_id: int, lp: float) -> TopLogprob:
                text = gen.decode(token_id)
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

        if not data.stream:
            out = await gen.final(first, agen)
            choices = [
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=logprobs(c.logprobs or []),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in out.outputs
            ]
            return Response(
                ChatCompletionResponse(
                    id=gen.id,
                    created=gen.created,
                    model=gen.model,
                    choices=choices,
                    usage=_usage(out),
                )
            )

        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        started: set[int] = set()
        reported: set[int] = set()

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=gen.id, created=gen.created, model=gen.model, choices=[choice]
            )

        def chunks(out: RequestOutput) -> list[ChatCompletionChunk]:
            result = []
            for c in out.outputs:
                if c.index not in started:  # OpenAI opens each choice with the role
                    started.add(c.index)
                    result.append(
                        chunk(
                            ChatChunkChoice(
                                index=c.index, delta=DeltaMessage(role="assistant", content="")
                            )
                        )
                    )
                if c.index in reported or not (
                    c.delta_text or c.delta_token_ids or c.finish_reason
                ):
                    continue
                if c.finish_reason:
                    reported.add(c.index)
                delta = DeltaMessage(content=c.delta_text) if c.delta_text else DeltaMessage()
                result.append(
                    chunk(
                        ChatChunkChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=logprobs(c.delta_logprobs),
                            finish_reason=c.finish_reason,
                        )
                    )
                )
            return result

        return gen.stream(
            first,
            agen,
            include_usage,
            chunks,
            lambda u: ChatCompletionChunk(
                id=gen.id, created=gen.created, model=gen.model, choices=[], usage=u
            ),
        )
