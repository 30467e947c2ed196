"""Structured outputs and tool calling over gRPC: the same capability as REST (the pipeline is
shared, service/tools.py), in moeserve.v1's messages."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from service.proto.moeserve.v1 import inference_pb2 as pb

USER = [pb.ChatMessage(role="user", content="What is the weather in Paris?")]
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(name="get_weather", description="weather", parameters=json.dumps(PARAMETERS))
BOUNDED = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def _generate(server, **request) -> pb.GenerateResponse:
    params = request.pop("params", pb.SamplingParams(max_tokens=60))
    return server.stub.Generate(pb.GenerateRequest(params=params, **request), timeout=60)


def test_json_schema_output_validates(server):
    r = _generate(
        server,
        prompt="Person:",
        structured_output=pb.StructuredOutput(json_schema=json.dumps(BOUNDED)),
    )
    jsonschema.validate(json.loads(r.text), BOUNDED)
    assert r.finish_reason == "stop"


def test_regex_and_choice_hold_on_every_streamed_sample(server):
    params = pb.SamplingParams(max_tokens=8, n=3, temperature=1.0)
    for constraint, ok in (
        (pb.StructuredOutput(regex="[xy]{2,4}"), lambda t: re.fullmatch("[xy]{2,4}", t)),
        (
            pb.StructuredOutput(choice=pb.Choice(options=["red", "blue"])),
            {"red", "blue"}.__contains__,
        ),
    ):
        request = pb.GenerateRequest(prompt="Go", params=params, structured_output=constraint)
        texts: dict[int, str] = {}
        for m in server.stub.GenerateStream(request, timeout=60):
            texts[m.index] = texts.get(m.index, "") + m.text
        assert len(texts) == 3 and all(ok(t) for t in texts.values()), texts


def test_logit_bias_forces_a_token(server):
    tokenizer = server.engine.tokenizer
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    params = pb.SamplingParams(max_tokens=3, temperature=1.0, logit_bias={token: 100.0})
    r = _generate(server, prompt="Hi", params=params)
    assert list(r.token_ids) == [token] * 3


def test_required_tool_call_is_made_and_valid(server):
    r = _generate(
        server,
        messages=USER,
        tools=[WEATHER],
        tool_choice=pb.ToolChoice(mode="required"),
        parallel_tool_calls=False,
    )
    [call] = r.tool_calls
    assert call.id.startswith("call_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    assert r.finish_reason == "tool_calls" and r.text == ""


def test_named_tool_call_streams_argument_fragments_that_reassemble(server):
    request = pb.GenerateRequest(
        messages=USER,
        params=pb.SamplingParams(max_tokens=60, seed=5, temperature=1.0),
        tools=[WEATHER],
        tool_choice=pb.ToolChoice(function="get_weather"),
    )
    messages = list(server.stub.GenerateStream(request, timeout=60))
    deltas = [c for m in messages for c in m.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].name == "get_weather"
    assert all(not d.id and not d.name for d in deltas[1:]) and len(deltas) > 1
    arguments = "".join(d.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), PARAMETERS)
    assert messages[-1].finish_reason == "stop"
    whole = server.stub.Generate(request, timeout=60)  # seeded: the same call, unstreamed
    assert whole.tool_calls[0].arguments == arguments


def test_auto_reads_the_models_own_syntax(server):
    canned = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'
    r = _generate(
        server,
        messages=USER,
        tools=[WEATHER],
        structured_output=pb.StructuredOutput(choice=pb.Choice(options=[canned])),
        params=pb.SamplingParams(max_tokens=200),
    )
    assert r.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 1})
    ]


def test_an_earlier_tool_call_and_its_result_are_rendered(server):
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome", "days": 1}')
    conversation = [
        *USER,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    short = server.stub.Tokenize(pb.TokenizeRequest(messages=USER), timeout=30).count
    r = _generate(
        server, messages=conversation, tools=[WEATHER], params=pb.SamplingParams(max_tokens=2)
    )
    assert r.usage.prompt_tokens > short


@pytest.mark.parametrize(
    "field,request_fields",
    [
        ("structured_output", {"prompt": "x", "structured_output": pb.StructuredOutput(regex="((")}),
        ("structured_output", {"prompt": "x", "structured_output": pb.StructuredOutput(grammar="start: nope")}),
        ("tool_choice", {"messages": USER, "tools": [WEATHER], "tool_choice": pb.ToolChoice(function="nope")}),
        ("tool_choice.mode", {"messages": USER, "tools": [WEATHER], "tool_choice": pb.ToolChoice(mode="always")}),
        ("tools[0].parameters", {"messages": USER, "tools": [pb.Tool(name="f", parameters="{nope")]}),
        ("tools", {"prompt": "x", "tools": [WEATHER]}),
        ("params.logit_bias", {"prompt": "x", "params": pb.SamplingParams(logit_bias={2**30: 1.0})}),
    ],
)  # fmt: skip
def test_bad_constraints_are_invalid_argument_naming_the_field(server, field, request_fields):
    with pytest.raises(grpc.RpcError) as err:
        _generate(server, **request_fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details(), err.value.details()
    # still serving (token ids, not text: two sampled tokens may decode to nothing)
    still = _generate(
        server, prompt="fine", params=pb.SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert len(still.token_ids) == 2
