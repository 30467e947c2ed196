"""REST and gRPC give the same verdict on the same invalid input.

One table, one row per validation rule the two APIs share (service/validation.py, the engine's
SamplingParams and its prompt limits in inference/prompts.py): the invalid input as a REST body
(or header) for /v1/completions, /v1/chat/completions or /tokenize, and as a gRPC request for
Generate, GenerateStream or Tokenize, and the field the refusal must name. Every probe of a row
must be refused as invalid: REST with 400 and `error.param` naming the field, gRPC with
INVALID_ARGUMENT whose details name it (sampling fields as the proto spells their path,
`params.<field>`). A new rule is one more row; the sampling rows are derived from
`BAD_SAMPLING`, which must cover every field of pb.SamplingParams.

The gRPC API has no model field, so the REST 404 for an unknown model has no gRPC twin
(`test_grpc_has_no_model_field` fails when one is added: add its row then).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import msgspec
import pytest

from bench.harness import InProcessServer
from inference import SamplingParams
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from service.server import MoeServer
from service.settings import Settings

MODEL = "demo-tiny"
MAX_MODEL_LEN = 128
TIMEOUT = 30
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
LONG = " ".join(["word"] * 2 * MAX_MODEL_LEN)  # more tokens than the context holds
_DROP = object()  # a body override that removes the key
_KEEP = object()  # Rule.chat_template: leave the model's template as it is

# A template that refuses system messages the way HF templates do (raise_exception).
REJECTING_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'system' %}"
    "{{ raise_exception('system messages are not supported') }}{%- endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
)


# ---- probes: one invalid input on one API --------------------------------------------------
@dataclass(frozen=True)
class Probe:
    label: str  # "POST /v1/completions", "Generate", ...
    field: str | None  # None: the rule's field
    path: str | None = None  # REST route; None: a gRPC method
    body: dict | None = None
    headers: dict = field(default_factory=dict)
    method: str | None = None
    request: Any = None


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for k, v in overrides.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_USER = [{"role": "user", "content": "Hello"}]
_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
_CHAT = {"model": MODEL, "messages": _USER, "max_tokens": 4}
_GENERATE = {"prompt": "Hello", "params": {"max_tokens": 4}}


def completion(*, headers: dict | None = None, field: str | None = None, **body) -> Probe:
    return Probe(
        "POST /v1/completions",
        field,
        path="/v1/completions",
        body=_merge(_COMPLETION, body),
        headers=headers or {},
    )


def chat(*, headers: dict | None = None, field: str | None = None, **body) -> Probe:
    return Probe(
        "POST /v1/chat/completions",
        field,
        path="/v1/chat/completions",
        body=_merge(_CHAT, body),
        headers=headers or {},
    )


def rest_tokenize(*, field: str | None = None, **body) -> Probe:
    return Probe("POST /tokenize", field, path="/tokenize", body={"model": MODEL, **body})


def _messages(messages: list[dict]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(**m) for m in messages]


def generate(*, field: str | None = None, **request) -> tuple[Probe, Probe]:
    """The same GenerateRequest on Generate and GenerateStream: `prompt` "Hello" unless
    `messages` (dicts) are given or `prompt=_DROP`; `params` merged over the base params."""
    params = {**_GENERATE["params"], **request.pop("params", {})}
    if "messages" in request:
        request["messages"] = _messages(request["messages"])
    else:
        request.setdefault("prompt", _GENERATE["prompt"])
    kwargs = {k: v for k, v in request.items() if v is not _DROP}
    message = pb.GenerateRequest(params=pb.SamplingParams(**params), **kwargs)
    form = " (messages)" if message.messages and not message.prompt else ""
    return tuple(
        Probe(m + form, field, method=m, request=message) for m in ("Generate", "GenerateStream")
    )


def tokenize(*, field: str | None = None, **request) -> Probe:
    if "messages" in request:
        request["messages"] = _messages(request["messages"])
    return Probe("Tokenize", field, method="Tokenize", request=pb.TokenizeRequest(**request))


# ---- rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str
    field: str  # what the refusal names (REST `param`; gRPC details, `params.` for sampling)
    probes: tuple[Probe, ...]
    chat_template: Any = _KEEP  # the model's chat template while the row runs

    @property
    def id(self) -> str:
        return self.name


def rule(name: str, field: str, *probes: Probe | tuple[Probe, ...], chat_template=_KEEP) -> Rule:
    flat: list[Probe] = []
    for p in probes:
        flat.extend(p if isinstance(p, tuple) else (p,))
    return Rule(name, field, tuple(flat), chat_template)


# Invalid values of every SamplingParams rule that both APIs can express (the proto's unsigned
# fields cannot carry a negative number, JSON cannot carry NaN): one override dict per probe.
BAD_SAMPLING: dict[str, list[dict]] = {
    "max_tokens": [{"max_tokens": 0}],
    "min_tokens": [{"min_tokens": 5, "max_tokens": 4}],
    "temperature": [{"temperature": -0.5}, {"temperature": 100.5}],
    "top_p": [{"top_p": 0.0}, {"top_p": 1.5}],
    "top_k": [{"top_k": -2}],
    "min_p": [{"min_p": -0.5}, {"min_p": 1.5}],
    "seed": [{"seed": 2**63}],
    "stop": [{"stop": [""]}, {"stop": [f"s{i}" for i in range(9)]}],
    "stop_token_ids": [{"stop_token_ids": [2**32 - 1]}],  # beyond the vocabulary (prompts.py)
    "presence_penalty": [{"presence_penalty": -2.5}, {"presence_penalty": 2.5}],
    "frequency_penalty": [{"frequency_penalty": -2.5}, {"frequency_penalty": 2.5}],
    "repetition_penalty": [{"repetition_penalty": 0.0}, {"repetition_penalty": 10.5}],
    "logprobs": [{"logprobs": 21}],
    "n": [{"n": 0}, {"n": 17}],
    "logit_bias": [{"logit_bias": {1: 100.5}}, {"logit_bias": {2**20: 1.0}}],  # range, vocabulary
}
NO_RULE = {
    "ignore_eos": "a bool has no invalid value",
    "skip_special_tokens": "a bool has no invalid value",
}
# Not proto SamplingParams fields: GenerateRequest.structured_output (rows of its own below),
# prompt_logprobs, a field of GenerateRequest and of the completions body (test_prompt_scoring
# in tests/service and tests/grpc), and reasoning_end, which the service sets (its reasoning
# parser's end marker).
ELSEWHERE = {"structured_outputs", "prompt_logprobs", "reasoning_end"}
# A case about one element of a list (or a value of a map) names its path, on both APIs.
ELEMENT_FIELD = {
    repr({"stop": [""]}): "stop[0]",
    repr({"logit_bias": {1: 100.5}}): "logit_bias[...]",
}


def _chat_sampling(values: dict) -> tuple[dict, str | None]:
    """A sampling override as the chat body spells it, and the field it names there."""
    if "logprobs" in values:  # chat: logprobs is a bool, the count is top_logprobs
        return {"logprobs": True, "top_logprobs": values["logprobs"]}, "top_logprobs"
    return values, None


def _sampling_rows() -> list[Rule]:
    rows = []
    for name, cases in BAD_SAMPLING.items():
        for values in cases:
            chat_values, chat_field = _chat_sampling(values)
            rows.append(
                rule(
                    f"params:{','.join(f'{k}={v!r}' for k, v in values.items())}"[:80],
                    ELEMENT_FIELD.get(repr(values), name),
                    completion(**values),
                    chat(field=chat_field, **chat_values),
                    generate(params=values),
                    generate(messages=_USER, params=values),
                )
            )
    return rows


_SYSTEM = [{"role": "system", "content": "be brief"}, *_USER]
_TOOL = {"type": "function", "function": {"name": "get_weather"}}
_PB_TOOL = pb.Tool(name="get_weather")
_BAD_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "wat"}},
}

RULES: list[Rule] = [
    # request id (validation.request_id): header x-request-id on REST, field request_id on gRPC
    rule(
        "request_id: bad characters",
        "request_id",
        completion(headers={"x-request-id": "bad/id"}),
        chat(headers={"x-request-id": "bad/id"}),
        generate(request_id="bad/id"),
    ),
    rule(
        "request_id: over 128 characters",
        "request_id",
        completion(headers={"x-request-id": "a" * 129}),
        chat(headers={"x-request-id": "a" * 129}),
        generate(request_id="a" * 129),
    ),
    # prompt / messages (validation.one_of, text_ids, chat_ids)
    rule("prompt: empty", "prompt", completion(prompt=""), generate(prompt="")),
    rule(
        "prompt/messages: neither",
        "prompt",
        completion(prompt=_DROP),
        generate(prompt=_DROP),
    ),
    rule(
        "prompt/messages: both",
        "prompt",
        completion(messages=_USER, field="messages"),  # an unknown field of the completions body
        chat(prompt="Hello"),  # an unknown field of the chat body
        generate(prompt="Hello", messages=_USER),
    ),
    rule("messages: empty", "messages", chat(messages=[]), generate(messages=[])),
    rule(
        "messages: role empty",
        "messages[0].role",
        chat(messages=[{"role": "", "content": "Hello"}]),
        generate(messages=[{"role": "", "content": "Hello"}]),
    ),
    rule(
        "messages: role unknown",
        "messages[0].role",
        chat(messages=[{"role": "wizard", "content": "Hello"}]),
        generate(messages=[{"role": "wizard", "content": "Hello"}]),
    ),
    rule(
        "messages: no chat template",
        "messages",
        chat(),
        generate(messages=_USER),
        chat_template=None,
    ),
    rule(
        "messages: chat template rejects them",
        "messages",
        chat(messages=_SYSTEM),
        generate(messages=_SYSTEM),
        chat_template=REJECTING_TEMPLATE,
    ),
    # engine limits (inference/prompts.py)
    rule(
        "prompt: over max_model_len",
        "prompt",
        completion(prompt=LONG),
        chat(messages=[{"role": "user", "content": LONG}], max_tokens=_DROP),
        generate(prompt=LONG),
        generate(messages=[{"role": "user", "content": LONG}]),
    ),
    rule(
        "max_tokens: prompt + max_tokens over max_model_len",
        "max_tokens",
        completion(max_tokens=MAX_MODEL_LEN),
        chat(max_tokens=MAX_MODEL_LEN),
        generate(params={"max_tokens": MAX_MODEL_LEN}),
        generate(messages=_USER, params={"max_tokens": MAX_MODEL_LEN}),
    ),
    *_sampling_rows(),
    # structured outputs and tools (service/tools.py; the grammar compiles in the engine)
    rule(
        "structured: regex does not compile",
        "structured_outputs",
        completion(structured_outputs={"regex": "(("}),
        chat(structured_outputs={"regex": "(("}),
        generate(field="structured_output", structured_output=pb.StructuredOutput(regex="((")),
    ),
    rule(
        "structured: JSON schema is not one",
        "response_format",
        chat(response_format=_BAD_SCHEMA_FORMAT),
        generate(
            field="structured_output",
            structured_output=pb.StructuredOutput(json_schema='{"type": "wat"}'),
        ),
    ),
    rule(
        "structured: no kind set",
        "structured_outputs",
        completion(structured_outputs={"regex": None}),
        generate(field="structured_output", structured_output=pb.StructuredOutput(choice={})),
    ),
    rule(
        "tools: tool_choice without tools",
        "tool_choice",
        chat(tool_choice="required"),
        generate(messages=_USER, tool_choice=pb.ToolChoice(mode="required")),
    ),
    rule(
        "tools: named function not among them",
        "tool_choice",
        chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        generate(messages=_USER, tools=[_PB_TOOL], tool_choice=pb.ToolChoice(function="nope")),
    ),
    rule(
        "tools: forced call and a response format",
        "tools",
        chat(tools=[_TOOL], tool_choice="required", response_format={"type": "json_object"}),
        generate(
            messages=_USER,
            tools=[_PB_TOOL],
            tool_choice=pb.ToolChoice(mode="required"),
            structured_output=pb.StructuredOutput(json_object=True),
        ),
    ),
    # Tokenize: the proto's `text` is REST's `prompt`
    rule(
        "tokenize: neither text nor messages",
        "prompt",
        rest_tokenize(),
        tokenize(field="text"),
    ),
    rule(
        "tokenize: both text and messages",
        "prompt",
        rest_tokenize(prompt="Hello", messages=_USER),
        tokenize(text="Hello", messages=_USER, field="text"),
    ),
    rule(
        "tokenize: empty text",
        "prompt",
        rest_tokenize(prompt=""),
        tokenize(text="", field="text"),
    ),
    rule(
        "tokenize: role empty",
        "messages[0].role",
        rest_tokenize(messages=[{"role": "", "content": "Hello"}]),
        tokenize(messages=[{"role": "", "content": "Hello"}]),
    ),
    rule(
        "tokenize: no chat template",
        "messages",
        rest_tokenize(messages=_USER),
        tokenize(messages=_USER),
        chat_template=None,
    ),
    rule(
        "tokenize: chat template rejects them",
        "messages",
        rest_tokenize(messages=_SYSTEM),
        tokenize(messages=_SYSTEM),
        chat_template=REJECTING_TEMPLATE,
    ),
]


# ---- the server: REST and gRPC in one MoeServer ---------------------------------------------
@dataclass
class Both:
    server: MoeServer
    http: httpx.Client
    stub: inference_pb2_grpc.InferenceStub

    @property
    def tokenizer(self):
        return self.server.state.engine.tokenizer


@pytest.fixture(scope="module")
def both(model_path) -> Iterator[Both]:
    settings = Settings(
        model=str(model_path),
        served_model_name=MODEL,
        port=0,
        grpc_port=0,
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=4096,
        max_num_seqs=4,
        drain_timeout=1,
    )
    with InProcessServer(settings) as srv:
        channel = grpc.insecure_channel(srv.grpc_target)
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as http:
            yield Both(srv.server, http, inference_pb2_grpc.InferenceStub(channel))
        channel.close()


@contextlib.contextmanager
def _chat_template(tokenizer, template) -> Iterator[None]:
    if template is _KEEP:
        yield
        return
    saved = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        yield
    finally:
        tokenizer.chat_template = saved


# ---- verdicts ------------------------------------------------------------------------------
def grpc_name(name: str) -> str:
    return f"params.{name}" if name.split("[")[0] in SAMPLING_FIELDS else name


def _names(details: str, name: str) -> bool:
    """`name` occurs in `details` as a whole field path (not `max_tokens` in `min_tokens`, not
    `messages` in `messages[0].role`)."""
    return re.search(rf"(?<![\w.\[]){re.escape(name)}(?![\w.\[])", details) is not None


def expected(probe: Probe, rule_field: str) -> str:
    name = probe.field or rule_field
    if probe.path is not None:
        return f"400 param={name}"
    return f"INVALID_ARGUMENT naming {grpc_name(name)}"


def verdict(both: Both, probe: Probe, rule_field: str) -> str:
    """What the API answered, in the words of `expected` when it named the field."""
    name = probe.field or rule_field
    if probe.path is not None:
        r = both.http.post(probe.path, json=probe.body, headers=probe.headers)
        if r.status_code == 200:
            return "200 (accepted)"
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} {r.text[:200]!r}"
        if r.status_code == 400 and error.get("param") == name:
            return f"400 param={name}"
        return f"{r.status_code} param={error.get('param')} ({error.get('message')!r})"[:300]
    rpc = getattr(both.stub, probe.method)
    try:
        result = rpc(probe.request, timeout=TIMEOUT)
        if probe.method == "GenerateStream":
            list(result)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and _names(details, grpc_name(name)):
            return f"INVALID_ARGUMENT naming {grpc_name(name)}"
        return f"{exc.code().name} ({details!r})"[:300]
    return "OK (accepted)"


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("row", RULES, ids=lambda r: r.id)
def test_rest_and_grpc_refuse_the_same_input_naming_the_same_field(both, row: Rule):
    with _chat_template(both.tokenizer, row.chat_template):
        answers = {p.label: verdict(both, p, row.field) for p in row.probes}
    wanted = {p.label: expected(p, row.field) for p in row.probes}
    assert answers == wanted


def test_every_rule_has_both_apis():
    for row in RULES:
        kinds = {p.path is not None for p in row.probes}
        assert kinds == {True, False}, row.name
        assert len({p.label for p in row.probes}) == len(row.probes), row.name
    assert len({r.id for r in RULES}) == len(RULES), "row names must be unique"


def test_table_covers_every_sampling_field():
    assert set(BAD_SAMPLING).isdisjoint(NO_RULE)
    assert set(BAD_SAMPLING) | set(NO_RULE) == SAMPLING_FIELDS
    # ... and every rule SamplingParams checks (its _check(..., "field", ...) calls)
    checked = set(re.findall(r'"(\w+)",\s*"must', inspect.getsource(SamplingParams)))
    # ... and every field whose annotation bounds it (inference/sampling_params.py)
    checked |= {
        f.name for f in msgspec.inspect.type_info(SamplingParams).fields if f.name not in NO_RULE
    }
    assert checked, "cannot read the rules of SamplingParams.__post_init__"
    assert checked - ELSEWHERE <= set(BAD_SAMPLING), checked - set(BAD_SAMPLING) - ELSEWHERE
    # every row of BAD_SAMPLING reached the table
    sampling_rows = {r.field.split("[")[0] for r in RULES if r.name.startswith("params:")}
    assert sampling_rows == set(BAD_SAMPLING)


def test_grpc_has_no_model_field():
    """No gRPC twin for REST's 404 on an unknown model; when the proto gains one, add a row
    (REST 404 param=model, gRPC NOT_FOUND naming model)."""
    for message in (pb.GenerateRequest, pb.TokenizeRequest):
        assert "model" not in message.DESCRIPTOR.fields_by_name
