"""moeserve.v1.Inference (SPEC section 7): gRPC messages in, service.generation updates out.

Each method parses its request into the shared validation (service/validation.py) and
renders what the Generation yields; errors, statuses and telemetry are handled around it
(service/grpc_server.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
import msgspec

from inference import InvalidParameterError, SamplingParams, StructuredOutputs
from inference.outputs import CompletionOutput, TokenLogprobs
from service import validation
from service.errors import BadRequest
from service.generation import Generation, Update
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.reasoning import (
    ChoiceParse,
    ReasoningPlan,
    reasoning_end,
    reasoning_plan,
    skip_special_tokens,
    special_texts,
)
from service.schemas import ChatMessage, FunctionCall, MessageToolCall, chat_message_dicts
from service.state import ServingState
from service.tools import TOOL_CHOICES, ToolPlan, single_constraint, tool_plan
from service.validation import GenerationInput

_REPEATED = ("stop", "stop_token_ids")
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


class InferenceServicer:
    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, gen: Generation
    ) -> pb.GenerateResponse:
        spec, plan, reasoning = await self._parse(request, stream=False)
        if spec.params.n > 1:
            raise BadRequest(
                "params.n must be 1 for Generate; use GenerateStream for n > 1", param="params.n"
            )
        final = await gen.final(spec)
        c = final.output.outputs[0]
        response = _response(gen, c, c.text, c.token_ids, c.logprobs or [])
        response.prompt_logprobs.extend(_logprobs((final.output.prompt_logprobs or [None])[1:]))
        if plan is not None or reasoning is not None:
            parse = self._choice_parse(request, plan, reasoning)
            thought, content, calls = parse.whole(c.text)
            response.text, response.reasoning_content = content or "", thought or ""
            response.tool_calls.extend(
                pb.ToolCall(index=i, id=t.id, name=t.name, arguments=t.arguments)
                for i, t in enumerate(calls)
            )
            response.finish_reason = parse.finish_reason(c.finish_reason) or ""
        response.usage.CopyFrom(_usage(final))
        if spec.include_metrics:
            response.metrics.CopyFrom(_metrics(final))
        return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, gen: Generation
    ) -> None:
        spec, plan, reasoning = await self._parse(request, stream=True)
        streams: dict[int, ChoiceParse] = {}
        scored = None  # the prompt's logprobs go out on the first message
        async for update in gen.updates(spec):
            chunks = [
                _response(gen, c, c.delta_text, c.delta_token_ids, c.delta_logprobs)
                for c in update.choices
            ]
            if chunks and scored is None and update.output.prompt_logprobs is not None:
                scored = update.output.prompt_logprobs
                chunks[0].prompt_logprobs.extend(_logprobs(scored[1:]))
            if plan is not None or reasoning is not None:
                for chunk, c in zip(chunks, update.choices):
                    parse = streams.setdefault(
                        c.index, self._choice_parse(request, plan, reasoning)
                    )
                    _parsed_deltas(chunk, c, parse)
            if update.finished:
                if not chunks:
                    chunks.append(pb.GenerateResponse(request_id=gen.request_id))
                chunks[-1].usage.CopyFrom(_usage(update))
                if spec.include_metrics:
                    chunks[-1].metrics.CopyFrom(_metrics(update))
            for chunk in chunks:
                await context.write(chunk)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        validation.one_of(("text", request.text), ("messages", request.messages))
        ids = await self._prompt_ids(request.text, request.messages, None, None)  # as Generate
        tokenizer = self.state.engine.tokenizer
        return pb.TokenizeResponse(
            token_ids=ids,
            tokens=tokenizer.convert_ids_to_tokens(ids),
            count=len(ids),
            max_model_len=self.state.engine.max_model_len,
        )

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        engine = self.state.engine
        args = engine.args
        return pb.ModelInfoResponse(
            model_name=self.state.model_name,
            architecture=args.architecture,
            max_model_len=engine.max_model_len,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
            num_experts_per_token=args.top_k,
            dtype=engine.dtype,
            device=engine.device,
            quantization=engine.quantization,
            kv_cache_dtype=engine.kv_cache_dtype,
            weight_bytes=engine.weight_bytes,
            kv_cache_tokens=engine.kv_cache_tokens,
            kv_cache_bytes=engine.kv_cache_bytes,
        )

    async def _parse(
        self, request: pb.GenerateRequest, stream: bool
    ) -> tuple[GenerationInput, ToolPlan | None, ReasoningPlan | None]:
        validation.one_of(("prompt", request.prompt), ("messages", request.messages))
        plan = _tool_plan(request, self.state.tool_parser)
        if plan is not None and not request.messages:
            raise BadRequest("tools need messages (a chat)", param="tools")
        forced = plan.structured_outputs() if plan is not None else None
        constraint, field = single_constraint(
            ("structured_output", _structured_output(request)), ("tools", forced)
        )
        tools = plan.template_tools if plan is not None else None
        limit = self.state.engine.max_model_len
        ids = await self._prompt_ids(request.prompt, request.messages, tools, limit)
        parser = self.state.reasoning_parser if request.messages else None  # chats reason
        reasoning = reasoning_plan(parser, self.state.engine.tokenizer, ids)
        end = reasoning_end(self.state, reasoning, constraint)
        scored = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        params = _sampling_params(request.params, constraint, plan, reasoning, end, scored)
        operation = "chat" if request.messages else "text_completion"
        spec = GenerationInput(ids, params, operation, stream, field, request.include_metrics)
        return spec, plan, reasoning

    def _choice_parse(
        self, request: pb.GenerateRequest, plan: ToolPlan | None, reasoning: ReasoningPlan | None
    ) -> ChoiceParse:
        p = request.params
        asked = p.skip_special_tokens if p.HasField("skip_special_tokens") else None
        tokenizer = self.state.engine.tokenizer
        return ChoiceParse(reasoning, plan, special_texts(asked, plan, reasoning, tokenizer))

    async def _prompt_ids(
        self,
        text: str,
        messages: Sequence[pb.ChatMessage],
        tools: list[dict] | None,
        limit: int | None,
    ) -> list[int]:
        """`limit`: validation.text_ids'."""
        tokenizer = self.state.engine.tokenizer
        if not messages:
            return await validation.text_ids(tokenizer, text, limit)
        dicts = chat_message_dicts([_chat_message(m) for m in messages])
        return await validation.chat_ids(tokenizer, dicts, limit, tools=tools)


def _sampling_params(
    p: pb.SamplingParams,
    constraint: StructuredOutputs | None,
    plan: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    reasoning_end: str | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Unset optional scalars and empty lists and maps take the engine's defaults."""
    fields = {
        name: (list(getattr(p, name)) or None)
        if name in _REPEATED
        else (getattr(p, name) if p.HasField(name) else None)
        for name in SAMPLING_FIELDS - {"logit_bias"}
    }
    fields["skip_special_tokens"] = skip_special_tokens(
        fields["skip_special_tokens"], plan, reasoning
    )
    return validation.sampling_params(
        **fields,
        logit_bias=dict(p.logit_bias) or None,
        structured_outputs=constraint,
        reasoning_end=reasoning_end,
        prompt_logprobs=prompt_logprobs,
    )


def _structured_output(request: pb.GenerateRequest) -> StructuredOutputs | None:
    so = request.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    value = list(so.choice.options) if kind == "choice" else getattr(so, kind)
    try:  # the proto's json_schema is StructuredOutputs' json
        return StructuredOutputs(**{"json" if kind == "json_schema" else kind: value})
    except InvalidParameterError as exc:
        raise BadRequest(f"structured_output: {exc.message}", param="structured_output") from None


def _tool_plan(request: pb.GenerateRequest, parser: str) -> ToolPlan | None:
    tools = []
    for i, t in enumerate(request.tools):
        function = {"name": t.name, "description": t.description or None}
        try:
            function["parameters"] = json.loads(t.parameters) if t.parameters else None
        except ValueError as exc:
            raise BadRequest(f"not JSON: {exc}", param=f"tools[{i}].parameters") from None
        if function["parameters"] is not None and not isinstance(function["parameters"], dict):
            raise BadRequest("must be a JSON Schema object", param=f"tools[{i}].parameters")
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v}})
    choice = request.tool_choice
    which = choice.WhichOneof("choice")
    if which == "mode" and choice.mode not in TOOL_CHOICES:
        raise BadRequest(f"must be one of {', '.join(TOOL_CHOICES)}", param="tool_choice.mode")
    named = choice.function if which == "function" else None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    mode = choice.mode if which == "mode" else None
    return tool_plan(tools or None, mode, named, parallel, parser)


def _chat_message(m: pb.ChatMessage) -> ChatMessage:
    calls = [
        MessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in m.tool_calls
    ]
    return ChatMessage(
        role=m.role,
        content=m.content,
        name=m.name or None,
        tool_calls=calls or None,
        tool_call_id=m.tool_call_id or None,
    )


def _parsed_deltas(chunk: pb.GenerateResponse, c: CompletionOutput, parse: ChoiceParse) -> None:
    """A streamed message's text as reasoning, content and tool-call deltas (service/reasoning.py)."""
    reasoning, content, deltas = parse.feed(c.delta_text)
    if c.finish_reason:
        rest = parse.finish()
        reasoning, content = reasoning + rest.reasoning, content + rest.content
        deltas = deltas + rest.tool_calls
        chunk.finish_reason = parse.finish_reason(c.finish_reason) or ""
    chunk.text, chunk.reasoning_content = content, reasoning
    chunk.tool_calls.extend(
        pb.ToolCall(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
        for d in deltas
    )


def _response(
    gen: Generation, c: CompletionOutput, text: str, ids: list[int], logprobs: list[TokenLogprobs]
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=text,
        token_ids=ids,
        finish_reason=c.finish_reason or "",
        index=c.index,
        request_id=gen.request_id,
        logprobs=_logprobs(logprobs),
    )


def _usage(update: Update) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=update.usage.prompt_tokens, completion_tokens=update.usage.completion_tokens
    )


def _metrics(update: Update) -> pb.RequestMetrics:
    """The REST `metrics` object's fields; those that are None stay unset."""
    given = msgspec.structs.asdict(update.metrics())
    return pb.RequestMetrics(**{k: v for k, v in given.items() if v is not None})


def _logprobs(items: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
        for lp in items
    ]
