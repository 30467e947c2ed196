"""Structured outputs and tool calling over REST, through the official `openai` client (and
LangChain), on the random tiny demo model: the grammar alone must make its output valid, so
the schemas are bounded (enums, maxLength, maxItems) and the random model still finishes."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from bench.harness import InProcessServer
from tests.service.conftest import make_settings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Berlin"]
    country: Literal["France", "Italy", "Germany"]


@pytest.fixture(scope="module")
def srv(tiny_model_dir) -> Iterator[InProcessServer]:
    settings = make_settings(tiny_model_dir, max_model_len=1024, kv_cache_tokens=16384)
    with InProcessServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(srv) -> str:
    return srv.state.model_name


# ---- response_format and structured_outputs -------------------------------------------------
def test_parse_returns_the_pydantic_object(client, model):
    r = client.chat.completions.parse(
        model=model, messages=USER, response_format=City, max_tokens=40, seed=1
    )
    choice = r.choices[0]
    assert isinstance(choice.message.parsed, City), choice.message.content
    assert choice.finish_reason == "stop"


def test_json_schema_holds_on_every_sample(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": BOUNDED, "strict": True}}
    r = client.chat.completions.create(
        model=model, messages=USER, response_format=fmt, n=3, temperature=1.0, max_tokens=60
    )
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), BOUNDED)
        assert choice.finish_reason == "stop"


def test_json_object_is_a_json_object(client, model):
    r = client.chat.completions.create(
        model=model, messages=USER, response_format={"type": "json_object"}, max_tokens=60
    )
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut short by max_tokens: still a prefix of an object
        assert content.startswith("{")


def test_regex_and_choice_hold_on_every_sample(client, model):
    r = client.completions.create(
        model=model,
        prompt="Answer:",
        n=4,
        temperature=1.0,
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[a-c]{2,5}"}},
    )
    assert all(re.fullmatch("[a-c]{2,5}", c.text) for c in r.choices), [c.text for c in r.choices]
    options = ["yes", "no", "maybe not"]
    r = client.chat.completions.create(
        model=model,
        messages=USER,
        n=4,
        temperature=1.0,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": options}},
    )
    assert all(c.message.content in options for c in r.choices)
    assert all(c.finish_reason == "stop" for c in r.choices)


def test_a_lark_grammar_constrains_a_completion(client, model):
    grammar = 'start: "x" ("y" | "z")+'
    r = client.completions.create(
        model=model,
        prompt="Go",
        max_tokens=6,
        temperature=1.0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch("x[yz]+", r.choices[0].text), r.choices[0].text


def test_a_seeded_constrained_request_repeats(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": BOUNDED}}

    def once() -> str:
        r = client.chat.completions.create(
            model=model, messages=USER, response_format=fmt, seed=7, temperature=1, max_tokens=60
        )
        return r.choices[0].message.content

    assert once() == once()


def test_logit_bias_forces_and_bans_a_token(client, model, srv):
    token = srv.state.engine.tokenizer.encode("a", add_special_tokens=False)[0]
    r = client.completions.create(
        model=model, prompt="Hi", max_tokens=4, logit_bias={str(token): 100}, temperature=1.0
    )
    assert r.choices[0].text == srv.state.engine.tokenizer.decode([token] * 4)
    greedy = client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0)
    first = srv.state.engine.tokenizer.encode(greedy.choices[0].text, add_special_tokens=False)
    banned = client.completions.create(
        model=model, prompt="Hi", max_tokens=1, temperature=0, logit_bias={str(first[0]): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text


# ---- tools ----------------------------------------------------------------------------------
def _arguments(call) -> dict:
    return json.loads(call.function.arguments)


def test_tool_choice_required_calls_a_tool_with_valid_arguments(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(_arguments(call), tool["function"]["parameters"])
    assert choice.message.content is None


def test_a_named_function_is_called(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=30,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(_arguments(call), TIME["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"  # as OpenAI finishes a named call


def test_tool_choice_none_neither_offers_nor_calls(client, model, srv):
    base = {"model": model, "messages": USER, "max_tokens": 2, "temperature": 0}
    plain = client.chat.completions.create(**base)
    none = client.chat.completions.create(**base, tools=[WEATHER], tool_choice="none")
    offered = client.chat.completions.create(**base, tools=[WEATHER])
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools are not rendered
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens  # "auto": they are


# Canned model text in each family's own syntax, forced out of the random model with a choice
# constraint; tool_choice "auto" must read it as the call.
CANNED = {
    "hermes": 'Sure.<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 2}}\n</tool_call>',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 2}}]',
    "deepseek": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    'get_weather\n```json\n{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "deepseek_v31": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "glm45": "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
    "\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    # days is 2, not "2", only by the tool's schema: the request's tools reach the parser
    "minimax_m2": 'Sure.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
    'Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>',
}


@pytest.fixture
def parser(srv, request) -> Iterator[str]:
    """--tool-call-parser for one test (the plan reads the live settings)."""
    saved = srv.state.settings.tool_call_parser
    srv.state.settings.tool_call_parser = request.param
    try:
        yield request.param
    finally:
        srv.state.settings.tool_call_parser = saved


@pytest.mark.parametrize("parser", sorted(CANNED), indirect=True)
def test_auto_reads_each_familys_own_tool_call_syntax(client, model, parser):
    body = {
        "model": model,
        "messages": USER,
        "tools": [WEATHER],
        "max_tokens": 400,
        "extra_body": {"structured_outputs": {"choice": [CANNED[parser]]}},
    }
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _arguments(call) == {"city": "Paris", "days": 2}
    assert choice.message.content == (None if parser == "llama3_json" else "Sure.")
    # streamed: content and tool-call deltas reassemble into the same message
    content, calls, finish = _reassemble(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls"
    assert content == (choice.message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]


def test_auto_keeps_special_tokens_a_call_marker_may_be(client, model, srv):
    """Mistral's [TOOL_CALLS] is a special token in its tokenizers: under tool_choice auto the
    text keeps special tokens (here the demo tokenizer's <|im_start|>, forced out)."""
    special = srv.state.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"model": model, "messages": USER, "max_tokens": 2, "logit_bias": {str(special): 100}}
    plain = client.chat.completions.create(**body)
    auto = client.chat.completions.create(**body, tools=[WEATHER])
    assert plain.choices[0].message.content in (None, "")
    assert auto.choices[0].message.content == "<|im_start|>" * 2


def _reassemble(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_forced_calls_reassemble_into_valid_calls(client, model, tool_choice):
    choice = (
        {"type": "function", "function": {"name": "get_weather"}}
        if tool_choice == "named"
        else "required"
    )
    stream = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=60,
        seed=3,
        stream=True,
    )
    content, calls, finish = _reassemble(stream)
    assert finish == ("stop" if tool_choice == "named" else "tool_calls")
    [call] = calls
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    assert content == ""


def test_a_conversation_with_tool_calls_and_results_is_rendered(client, model):
    first = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the random model cannot run on to max_tokens
        max_tokens=60,
    )
    message = first.choices[0].message
    [call, *_] = message.tool_calls
    follow_up = [
        *USER,
        message,  # the client's own message object, sent back as it came
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    r = client.chat.completions.create(
        model=model, messages=follow_up, tools=[WEATHER], max_tokens=4
    )
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


# ---- LangChain --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(srv, model, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{srv.url}/v1", api_key="unused", model=model, max_tokens=60, max_retries=0
    )
    # strict: the schema closes the object, so the random model cannot add keys without end
    structured = llm.with_structured_output(City, method=method, strict=True)
    city = structured.invoke("The capital of France?")
    assert isinstance(city, City)


# ---- errors -----------------------------------------------------------------------------------
BAD = [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}),
    ("structured_outputs", {"structured_outputs": {"regex": "(("}}),
    ("structured_outputs", {"structured_outputs": {"grammar": "start: nope"}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": []}}),
    ("tool_choice", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tools", {"tools": [WEATHER, WEATHER]}),
    ("tools", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}}}}], "tool_choice": "required"}),
    ("logit_bias", {"logit_bias": {"99999999": 1}}),
    ("logit_bias[...]", {"logit_bias": {"1": 101}}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
]  # fmt: skip


@pytest.mark.parametrize("param,extra", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(srv, model, param, extra):
    body = {"model": model, "messages": USER, "max_tokens": 4, **extra}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        assert http.get("/health").status_code == 200


def test_a_bad_constraint_does_not_disturb_the_batch(srv, model):
    good = {"model": model, "prompt": "Hello", "max_tokens": 12, "ignore_eos": True}
    bad = {**good, "structured_outputs": {"regex": "(("}}
    results: dict[str, int] = {}

    def send(name: str, body: dict) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json=body)
            results[name] = r.status_code
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 12

    threads = [
        threading.Thread(target=send, args=(f"{kind}{i}", body))
        for i in range(3)
        for kind, body in (("good", good), ("bad", bad))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results.items()) == sorted(
        {**{f"good{i}": 200 for i in range(3)}, **{f"bad{i}": 400 for i in range(3)}}.items()
    )
