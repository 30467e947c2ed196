"""Per-request sampling parameters (SPEC section 5), validated on construction."""

from __future__ import annotations

import functools
import math
import operator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from inference.errors import InvalidParameterError

# Each field's range, stated once: decoding (msgspec.convert, as both APIs build SamplingParams)
# enforces it, direct construction checks it in __post_init__, and the REST schemas
# (service/schemas.py) and so the OpenAPI document carry it.
MaxTokens = Annotated[int, Meta(ge=1, title="MaxTokens")]
MinTokens = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, description="-1 or 0: disabled")]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
Logprobs = Annotated[int, Meta(ge=0, le=20)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
StopString = Annotated[str, Meta(min_length=1)]
StopList = Annotated[list[StopString], Meta(max_length=8)]
TokenId = Annotated[int, Meta(ge=0, title="TokenId")]
LogitBias = Annotated[float, Meta(ge=-100.0, le=100.0)]  # OpenAI's range

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputs(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Grammar-constrained decoding (vLLM's `structured_outputs`); exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression the whole output matches; choice: the output is one of these strings;
    grammar: a Lark grammar as llguidance takes it (GBNF is converted). Whether the schema,
    regex or grammar compiles is checked where the grammar is compiled: LLMEngine.add_request
    raises InvalidParameterError naming e.g. "structured_outputs.json" (a grammar still
    compiling after 20 ms fails later, as the engine core's Rejected for that request).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(
            len(set_) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(STRUCTURED_KINDS)} (got {len(set_)})",
        )

    @property
    def kind(self) -> str:
        """ "json" | "json_object" | "regex" | "choice" | "grammar": the field that is set."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: MaxTokens = 16
    min_tokens: MinTokens = 0  # at most max_tokens
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: StopList = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    # False keeps special tokens' text (a tool-call marker such as Mistral's [TOOL_CALLS])
    skip_special_tokens: bool = True
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logprobs: Logprobs | None = None  # top-N logprobs per generated token (0: only the chosen one)
    # the same for each prompt token given the ones before it (vLLM's prompt_logprobs; such
    # a request reads its prompt through the model, not from the prefix cache: no logits there)
    prompt_logprobs: Logprobs | None = None
    n: NumChoices = 1
    structured_outputs: StructuredOutputs | None = None
    # text that ends the model's reasoning (a reasoning parser's end marker, e.g. "</think>"):
    # structured_outputs then constrain only the tokens after the output first contains it,
    # as vLLM's grammars start where its reasoning parser sees the reasoning end
    reasoning_end: StopString | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None  # token id -> bias added to its logit

    def __post_init__(self) -> None:
        for name, bounds in _field_bounds().items():
            _check_bounds(name, getattr(self, name), bounds)
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be at most max_tokens")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@functools.cache
def _field_bounds() -> dict[str, msgspec.inspect.Type]:
    return {f.name: f.type for f in msgspec.inspect.type_info(SamplingParams).fields}


_BOUNDS = (
    ("ge", ">=", operator.ge),
    ("gt", ">", operator.gt),
    ("le", "<=", operator.le),
    ("lt", "<", operator.lt),
)


def _check_bounds(name: str, value: Any, t: msgspec.inspect.Type) -> None:
    """The bounds of a field's annotation, for a directly constructed SamplingParams."""
    if isinstance(t, msgspec.inspect.Metadata):  # a description
        t = t.type
    if isinstance(t, msgspec.inspect.UnionType):  # `X | None`
        if value is None:
            return
        t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
    if isinstance(t, msgspec.inspect.DictType):
        _check(isinstance(value, dict), name, "must be an object")
        for key, item in value.items():
            _check_bounds(name, key, t.key_type)
            _check_bounds(name, item, t.value_type)
        return
    if isinstance(t, msgspec.inspect.ListType):
        _check(isinstance(value, list), name, "must be a list")
        _check(
            t.max_length is None or len(value) <= t.max_length,
            name,
            f"must have at most {t.max_length} items",
        )
        for item in value:
            _check_bounds(name, item, t.item_type)
        return
    if isinstance(t, msgspec.inspect.StrType):
        _check(
            isinstance(value, str) and len(value) >= (t.min_length or 0),
            name,
            f"must be a string of at least {t.min_length} characters",
        )
        return
    if not isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        return
    _check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value),
        name,
        "must be a number",
    )
    for attr, sign, ok in _BOUNDS:
        bound = getattr(t, attr)
        _check(bound is None or ok(value, bound), name, f"must be {sign} {bound}")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)
