"""OpenAI-compatible /v1 routes: completions, chat completions (JSON or SSE), models.

Each route parses its body into a validation.GenerationInput and hands it with a renderer to
`_respond`, which runs the request's service.generation.Generation and answers with the whole
response or its SSE chunks (service/controllers/openai_render.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from inference import InvalidParameterError, StructuredOutputs
from service import validation
from service.auth import reject_while_draining, require_api_key
from service.controllers.common import (
    cancel_on_disconnect,
    generation,
    generation_lifecycle,
    serving_state,
)
from service.controllers.openai_render import ChatRender, CompletionRender
from service.errors import BadRequest, ServiceError
from service.generation import Generation
from service.openapi_errors import errors
from service.prompt_scoring import echo_text, prompt_scoring
from service.reasoning import (
    reasoning_end,
    reasoning_plan,
    skip_special_tokens,
    special_texts,
)
from service.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from service.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    StreamOptions,
    chat_message_dicts,
    unsupported_fields,
)
from service.state import ServingState
from service.tools import ToolPlan, single_constraint, tool_plan
from service.validation import GenerationInput

_encode = msgspec.json.Encoder().encode
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_SAMPLING = (
    *("n", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k"),
    *("min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos"),
)  # skip_special_tokens: the tool plan may decide it (service/tools.py)


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


def _sampling(data: Any, constraint: StructuredOutputs | None, **fields: Any):
    bad = unsupported_fields(data)
    if bad:
        raise BadRequest(f"{bad[0]} is not supported by this server", param=bad[0])
    stop = [data.stop] if isinstance(data.stop, str) else data.stop
    bias = data.logit_bias and {int(token): b for token, b in data.logit_bias.items()}
    fields.setdefault("skip_special_tokens", data.skip_special_tokens)
    return validation.sampling_params(
        stop=stop,
        logit_bias=bias or None,
        structured_outputs=constraint,
        **fields,
        **{n: getattr(data, n) for n in _SAMPLING},
    )


def _constraint(data: Any, plan: ToolPlan | None) -> tuple[StructuredOutputs | None, str | None]:
    """The request's grammar constraint and the field it came from: `response_format`,
    vLLM's `structured_outputs`, or a tool_choice that forces a call; at most one of them."""
    rf, body, so = data.response_format, data.structured_outputs, None
    if isinstance(rf, JsonSchemaFormat) and rf.json_schema.schema is not None:
        so = StructuredOutputs(json=rf.json_schema.schema)
    elif isinstance(rf, (JsonObjectFormat, JsonSchemaFormat)):
        so = StructuredOutputs(json_object=True)
    extra = None
    if body is not None:
        given = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not None}
        try:
            extra = StructuredOutputs(**given)
        except InvalidParameterError as exc:
            raise BadRequest(exc.message, param="structured_outputs") from None
    forced = plan.structured_outputs() if plan is not None else None
    return single_constraint(
        ("response_format", so), ("structured_outputs", extra), ("tools", forced)
    )


def _tool_plan(data: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    choice = data.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return tool_plan(
        msgspec.to_builtins(data.tools) if data.tools else None,
        None if named else choice,
        named,
        data.parallel_tool_calls,
        parser,
    )


async def _completion_ids(state: ServingState, prompt: str | list[Any]) -> list[int]:
    """A string or a list of token ids; a one-element list of either is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await validation.text_ids(state.engine.tokenizer, prompt, state.engine.max_model_len)
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(
            "a list of several prompts is not supported; send one request per prompt",
            param="prompt",
        )
    return validation.token_ids(prompt)


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
        validation.check_model(state.model_name, data.model)
        max_tokens = data.max_tokens if data.max_tokens is not None else 16
        scoring = prompt_scoring(
            data.echo,
            max_tokens,
            data.min_tokens,
            data.logprobs,
            data.prompt_logprobs,
            data.stream,
        )
        constraint, field = _constraint(data, None)
        params = _sampling(
            data,
            constraint,
            max_tokens=max(max_tokens, 1),  # max_tokens 0: the one sampled token is dropped
            logprobs=data.logprobs,
            prompt_logprobs=scoring.engine_prompt_logprobs,
        )
        ids = await _completion_ids(state, data.prompt)
        spec = GenerationInput(
            ids, params, "text_completion", data.stream, field, data.include_metrics
        )
        echoed = echo_text(data.prompt, ids, state.engine.tokenizer) if data.echo else ""
        render = CompletionRender(
            request, gen.response_id, params.n, data.logprobs is not None, scoring, echoed
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
        validation.check_model(state.model_name, data.model)
        if data.top_logprobs is not None and not data.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        plan = _tool_plan(data, state.tool_parser)
        constraint, field = _constraint(data, plan)
        messages = chat_message_dicts(data.messages)
        tools = plan.template_tools if plan else None
        ids = await validation.chat_ids(
            state.engine.tokenizer,
            messages,
            state.engine.max_model_len,
            data.add_generation_prompt,
            tools,
            data.continue_final_message,
        )
        max_tokens = next(
            (m for m in (data.max_completion_tokens, data.max_tokens) if m is not None),
            max(state.engine.max_model_len - len(ids), 1),  # OpenAI's default: the context
        )
        logprobs = (data.top_logprobs or 0) if data.logprobs else None
        reasoning = reasoning_plan(
            state.reasoning_parser if data.separate_reasoning else None,
            state.engine.tokenizer,
            ids,
            include=data.include_reasoning,
            held=not data.stream_reasoning,
        )
        specials = special_texts(data.skip_special_tokens, plan, reasoning, state.engine.tokenizer)
        params = _sampling(
            data,
            constraint,
            max_tokens=max_tokens,
            logprobs=logprobs,
            skip_special_tokens=skip_special_tokens(data.skip_special_tokens, plan, reasoning),
            reasoning_end=reasoning_end(state, reasoning, constraint),
        )
        spec = GenerationInput(ids, params, "chat", data.stream, field, data.include_metrics)
        render = ChatRender(request, gen.response_id, data.logprobs, plan, reasoning, specials)
        return await _respond(request, gen, spec, data.stream_options, render)
