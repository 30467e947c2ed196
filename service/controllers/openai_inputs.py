"""A completion or chat request body -> what the engine is given: the prompt's token ids and
the sampling parameters, with what rendering the output needs (tool plan, reasoning plan,
prompt scoring). One function per route, used by the generation routes (openai.py) and by
vLLM's render routes (render.py), so a router or endpoint picker that renders a request gets
exactly the token ids its generation would run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from inference import InvalidParameterError, SamplingParams, StructuredOutputs
from service import validation
from service.errors import BadRequest
from service.prompt_scoring import PromptScoring, prompt_scoring
from service.reasoning import (
    ReasoningPlan,
    reasoning_end,
    reasoning_plan,
    skip_special_tokens,
    special_texts,
)
from service.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    chat_message_dicts,
    unsupported_fields,
)
from service.state import ServingState
from service.tools import ToolPlan, single_constraint, tool_plan

_SAMPLING = (
    *("n", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k"),
    *("min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos"),
)  # skip_special_tokens: the tool plan may decide it (service/tools.py)


@dataclass(frozen=True, slots=True)
class CompletionInput:
    ids: list[int]
    params: SamplingParams
    scoring: PromptScoring
    constraint_field: str | None


@dataclass(frozen=True, slots=True)
class ChatInput:
    ids: list[int]
    params: SamplingParams
    plan: ToolPlan | None
    reasoning: ReasoningPlan | None
    specials: tuple[str, ...]  # special tokens' texts the render removes (special_texts)
    constraint_field: str | None


def _sampling(data: Any, constraint: StructuredOutputs | None, **fields: Any) -> SamplingParams:
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


async def completion_input(state: ServingState, data: CompletionRequest) -> CompletionInput:
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
    return CompletionInput(ids, params, scoring, field)


async def chat_input(state: ServingState, data: ChatCompletionRequest) -> ChatInput:
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
    return ChatInput(ids, params, plan, reasoning, specials, field)
