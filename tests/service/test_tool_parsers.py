"""Tool-call parsers: canned outputs of each family parsed whole and streamed over many
chunkings (the same content and calls every way), the forced-call schema checked with
jsonschema, and the parser each served architecture gets (the demo checkpoints' own are
checked in tests/inference/test_demo_model.py)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.parsers.tool_calls import (
    PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    forced_calls,
    forced_calls_schema,
    parse_tool_calls,
    parser_for,
)

# Arguments that break naive parsers: braces and the closing markers inside strings,
# escaped quotes, nesting, every JSON literal, exponents, unicode raw and escaped.
NESTED = (
    '{"query": "a } b { \\"quoted\\" </tool_call> [TOOL_CALLS] ```", '
    '"nested": {"list": [1, -2.5e-3, true, false, null, {"x": "é 世界 🙂 \\u00e9\\n"}]}, '
    '"empty": {}, "array": []}'
)
WEATHER = '{"city": "Paris", "unit": "celsius"}'

DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL, DS_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def deepseek(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_END}"


def v31(name: str, args: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_END}"


KIMI_SEC, KIMI_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def kimi(call_id: str, args: str) -> str:
    return f"{KIMI_CALL}{call_id}{KIMI_ARGS}{args}{KIMI_END}"


def glm(name: str, *pairs: tuple[str, str]) -> str:
    """A call as the GLM-4.5 chat template writes one."""
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{args}</tool_call>"


MM_OPEN, MM_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"


def invoke(name: str, *pairs: tuple[str, str]) -> str:
    """One call as the MiniMax-M2 chat template writes it inside its block."""
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs)
    return f'<invoke name="{name}">\n{params}</invoke>\n'


def minimax(*invokes: str) -> str:
    return f"{MM_OPEN}\n{''.join(invokes)}{MM_CLOSE}"


# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    # hermes: Qwen2/Qwen3 and the demo model
    ("hermes", hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    (
        "hermes",
        hermes("get_weather", WEATHER) + "\n" + hermes("search", NESTED) + "\n",
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "hermes",
        "Let me check the weather.\n\n" + hermes("get_weather", WEATHER),
        "Let me check the weather.\n\n",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        hermes("get_weather", WEATHER) + "\nI asked for the weather.",
        "\nI asked for the weather.",
        [("get_weather", WEATHER)],
    ),
    (  # arguments first, compact, no newlines, no closing tag at the end of the output
        "hermes",
        '<tool_call>{"arguments":{"a":1},"name":"f"}',
        None,
        [("f", '{"a":1}')],
    ),
    (  # arguments as a JSON string holding the object
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": \\"}\\"}"}\n</tool_call>',
        None,
        [("f", '{"a": "}"}')],
    ),
    # malformed: stays content, byte for byte
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "same", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', "same", []),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "same", []),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>', "same", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} junk</tool_call>', "same", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "cut off', "same", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', "same", []),
    ("hermes", "a <tool_call is not <tool_call", "same", []),
    (  # nested deeper than the parser follows (64 levels): content, not a crash
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 80 + "]" * 80 + "}}</tool_call>",
        "same",
        [],
    ),
    ("hermes", "x < y and <tool_", "same", []),
    (  # a broken call, then a good one: the broken one is content
        "hermes",
        "<tool_call>\n{bad}\n</tool_call>\n" + hermes("f", "{}"),
        "<tool_call>\n{bad}\n</tool_call>\n",
        [("f", "{}")],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", <tool_call>{"name": "b", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", ',
        [("b", "{}")],
    ),
    ("hermes", "", None, []),
    ("hermes", "  \n", "  \n", []),
    # mistral: [TOOL_CALLS] then a JSON list (v3 tokenizers), or name[ARGS]{...} (v11+)
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}, "id": "a1b2c3d4e"}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        (
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
            f'{{"name": "search", "arguments": {NESTED}}}]'
        ),
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "mistral",
        f'I will look it up.[TOOL_CALLS][{{"name": "search", "arguments": {NESTED}}}]',
        "I will look it up.",
        [("search", NESTED)],
    ),
    (
        "mistral",
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]search[ARGS]{NESTED}",
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "mistral",
        f"Sure.[TOOL_CALLS]get_weather[CALL_ID]x1y2z3w4v[ARGS]{WEATHER}",
        "Sure.",
        [("get_weather", WEATHER)],
    ),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": 5}]', "same", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}', "same", []),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", "same", []),
    ("mistral", "[TOOL_CALLS]f[ARGS]{'a': 1}", "same", []),
    ("mistral", "Use [TOOL_ or [TOOL_CALLS without the bracket", "same", []),
    # deepseek: DeepSeek-V2.5/V3 tool-call tokens
    (
        "deepseek",
        DS_CALLS + deepseek("get_weather", WEATHER) + DS_CALLS_END,
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "deepseek",
        DS_CALLS
        + deepseek("get_weather", WEATHER)
        + "\n"
        + deepseek("search", NESTED)
        + DS_CALLS_END,
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "deepseek",
        "Checking both.\n" + DS_CALLS + deepseek("a", "{}") + deepseek("b", '{"k": [1]}'),
        "Checking both.\n",
        [("a", "{}"), ("b", '{"k": [1]}')],
    ),
    (  # the V3.1 form: NAME<sep>{...}
        "deepseek",
        f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{WEATHER}{DS_END}{DS_CALLS_END}",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "deepseek",
        f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n{{}}\n{DS_END}{DS_CALLS_END}",  # no ```json
        "same",
        [],
    ),
    ("deepseek", DS_CALLS + deepseek("f", '{"a": }') + DS_CALLS_END, "same", []),
    (  # the first call stands when the second is broken; the rest is content
        "deepseek",
        DS_CALLS + deepseek("a", "{}") + "\n" + deepseek("b", "[1]") + DS_CALLS_END,
        "\n" + deepseek("b", "[1]") + DS_CALLS_END,
        [("a", "{}")],
    ),
    # llama3_json: Llama 3.x JSON calls, SmolLM2's <tool_call> list
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "search", "arguments": {NESTED}}}',
        None,
        [("search", NESTED)],
    ),
    (
        "llama3_json",
        f' {{"name": "a", "parameters": {{}}}}; {{"name": "search", "parameters": {NESTED}}}',
        None,
        [("a", "{}"), ("search", NESTED)],
    ),
    (
        "llama3_json",
        (
            f'<tool_call>[\n{{"name": "get_weather", "arguments": {WEATHER}}},\n'
            f'{{"name": "search", "arguments": {NESTED}}}\n]</tool_call>'
        ),
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "llama3_json",
        'Here you go: <tool_call>[{"name": "f", "arguments": {"x": "y"}}]</tool_call>',
        "Here you go: ",
        [("f", '{"x": "y"}')],
    ),
    ("llama3_json", "<tool_call>[]</tool_call>", None, []),  # SmolLM2's "no call needed"
    ("llama3_json", '{"city": "Paris", "country": "France"}', "same", []),  # JSON, not a call
    ("llama3_json", 'The call would be {"name": "f", "parameters": {}}', "same", []),
    ("llama3_json", '{"name": "f", "parameters": {}, "arguments": {}}', "same", []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', "same", []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}\nand then some text',
        "\nand then some text",
        [("f", "{}")],
    ),
    # deepseek_v31: DeepSeek-V3.1's NAME<sep>{...} calls
    (
        "deepseek_v31",
        DS_CALLS + v31("get_weather", WEATHER) + DS_CALLS_END,
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "deepseek_v31",
        "Let me check.\n\n"
        + DS_CALLS
        + v31("a", "{}")
        + v31("search", NESTED)
        + DS_CALLS_END
        + "\n",
        "Let me check.\n\n",
        [("a", "{}"), ("search", NESTED)],
    ),
    (  # cut by max_tokens before the closing markers: the call stands
        "deepseek_v31",
        f'{DS_CALLS}{DS_CALL}f{DS_SEP}{{"a": 1}}',
        None,
        [("f", '{"a": 1}')],
    ),
    (  # cut inside the second call: the first stands, the rest is content
        "deepseek_v31",
        DS_CALLS + v31("a", "{}") + f'{DS_CALL}b{DS_SEP}{{"x": ',
        f'{DS_CALL}b{DS_SEP}{{"x": ',
        [("a", "{}")],
    ),
    ("deepseek_v31", DS_CALLS + deepseek("f", "{}") + DS_CALLS_END, "same", []),  # V3's form
    ("deepseek_v31", DS_CALLS + v31("f", "[1]") + DS_CALLS_END, "same", []),
    ("deepseek_v31", "Done." + DS_CALLS, "same", []),
    # kimi_k2: Kimi-K2's sections, the model's own ids
    (
        "kimi_k2",
        KIMI_SEC + kimi("functions.get_weather:0", WEATHER) + KIMI_SEC_END,
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "kimi_k2",
        "I'll check both."
        + KIMI_SEC
        + kimi("functions.get_weather:0", WEATHER)
        + kimi("functions.search:1", NESTED)
        + KIMI_SEC_END,
        "I'll check both.",
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (  # the singular section markers, an id without the functions. prefix, spaces
        "kimi_k2",
        (
            f'<|tool_call_section_begin|> {KIMI_CALL} f:0 {KIMI_ARGS} {{"a": 1}} {KIMI_END}'
            "<|tool_call_section_end|>"
        ),
        None,
        [("f", '{"a": 1}')],
    ),
    (
        "kimi_k2",
        KIMI_SEC + kimi("functions.a:0", "{}") + KIMI_CALL + "functions.b:1" + KIMI_ARGS + '{"x"',
        KIMI_CALL + "functions.b:1" + KIMI_ARGS + '{"x"',
        [("a", "{}")],
    ),
    ("kimi_k2", KIMI_SEC + kimi("functions.get_weather", "{}") + KIMI_SEC_END, "same", []),
    ("kimi_k2", KIMI_SEC + kimi("functions.f:0", '{"a": }') + KIMI_SEC_END, "same", []),
    ("kimi_k2", KIMI_SEC + kimi("functions.f:0", '"{}"') + KIMI_SEC_END, "same", []),
    # glm45: GLM-4.5's <arg_key>/<arg_value> calls (without tools: values read as JSON or
    # Python literals where they are, else strings)
    (
        "glm45",
        glm("get_weather", ("city", "Paris"), ("unit", "celsius")),
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "glm45",
        "Let me look.\n" + glm("a") + "\n" + glm("search", ("query", 'a } b "q" </tool_call>')),
        "Let me look.\n",
        [("a", "{}"), ("search", '{"query": "a } b \\"q\\" </tool_call>"}')],
    ),
    (
        "glm45",
        glm(
            "f",
            ("days", "5"),
            ("flags", '{"a": [1, true]}'),
            ("ok", "True"),
            ("none", "None"),
            ("q", "'single'"),
            ("nan", "NaN"),
            ("huge", "1e999"),
            ("text", " two words "),
        ),
        None,
        [
            (
                "f",
                (
                    '{"days": 5, "flags": {"a": [1, true]}, "ok": true, "none": null, '
                    '"q": "single", "nan": "NaN", "huge": "1e999", "text": "two words"}'
                ),
            )
        ],
    ),
    ("glm45", "<tool_call>now</tool_call>", None, [("now", "{}")]),
    (  # name and arguments on one line, as GLM-4.5-Air is seen writing them
        "glm45",
        "<tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> </tool_call>",
        None,
        [("ls", '{"dirPath": "backend"}')],
    ),
    (  # cut by max_tokens after a whole argument: the call stands
        "glm45",
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_",
        None,
        [("f", '{"a": 1}')],
    ),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", "same", []),
    ("glm45", "<tool_call>get_weather", "same", []),  # may be cut mid-name
    ("glm45", hermes("f", "{}"), "same", []),
    (
        "glm45",
        "<tool_call>f\n<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>",
        "same",
        [],
    ),
    (
        "glm45",
        "<tool_call>bad name\n</tool_call>" + glm("f", ("x", "[1, 2]")),
        "<tool_call>bad name\n</tool_call>",
        [("f", '{"x": [1, 2]}')],
    ),
    # minimax_m2: MiniMax-M2's <invoke> calls (without tools: values are strings)
    (
        "minimax_m2",
        minimax(invoke("get_weather", ("city", "Paris"), ("days", "5"))),
        None,
        [("get_weather", '{"city": "Paris", "days": "5"}')],
    ),
    (
        "minimax_m2",
        "Checking both.\n"
        + minimax(invoke("a"), invoke("search", ("q", 'x } "y" <b>')))
        + "\nDone.",
        "Checking both.\n\nDone.",
        [("a", "{}"), ("search", '{"q": "x } \\"y\\" <b>"}')],
    ),
    (  # single-quoted and bare names; null; a multi-line value loses its edge newlines
        "minimax_m2",
        (
            f"{MM_OPEN}<invoke name='run'><parameter name=code>\ndef f():\n    return 1\n"
            f'</parameter><parameter name="x">null</parameter></invoke>{MM_CLOSE}'
        ),
        None,
        [("run", '{"code": "def f():\\n    return 1", "x": null}')],
    ),
    (  # cut by max_tokens after a whole call: it stands
        "minimax_m2",
        MM_OPEN + "\n" + invoke("f", ("a", "1")),
        None,
        [("f", '{"a": "1"}')],
    ),
    (  # cut inside the second call: the first stands, the rest is content
        "minimax_m2",
        MM_OPEN + invoke("a") + '<invoke name="b">\n<parameter name="x">1',
        '\n<invoke name="b">\n<parameter name="x">1',
        [("a", "{}")],
    ),
    ("minimax_m2", f"{MM_OPEN}\n{MM_CLOSE}", "same", []),
    (
        "minimax_m2",
        f'{MM_OPEN}<invoke name="f"><parameter name="a">1</invoke>{MM_CLOSE}',
        "same",
        [],
    ),
    ("minimax_m2", f'{MM_OPEN}<invoke name="two words"></invoke>{MM_CLOSE}', "same", []),
]


def _chunkings(text: str, seed: int):
    yield list(text)  # character by character
    for i in range(1, len(text)):  # every split in two
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(20 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(
    parser: str, chunks: list[str], tools: list[dict] | None = None
) -> tuple[str, list[ToolCallDelta], list[ToolCall]]:
    s = ToolCallStream(parser, tools)
    content, deltas = "", []
    for chunk in chunks:
        c, d = s.feed(chunk)
        content, deltas = content + c, deltas + d
    c, d = s.finish()
    return content + c, deltas + d, s.calls


def check_deltas(deltas: list[ToolCallDelta], calls: list[ToolCall]) -> None:
    """Deltas in OpenAI's shape that reassemble into exactly the calls."""
    assembled: dict[int, dict] = {}
    for d in deltas:
        if d.index not in assembled:
            assert d.index == len(assembled) and d.id and d.name
            assembled[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.id is None and d.name is None
        assembled[d.index]["arguments"] += d.arguments
    assert [ToolCall(**a) for _, a in sorted(assembled.items())] == calls


def names_args(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "expected"), CASES)
def test_whole_text(parser, text, content, expected):
    got_content, calls = parse_tool_calls(parser, text)
    assert got_content == (text if content == "same" else content)
    assert names_args(calls) == expected
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("parser", "text", "content", "expected"), CASES)
def test_streamed_over_chunkings(parser, text, content, expected):
    whole_content, whole_calls = parse_tool_calls(parser, text)
    for i, chunks in enumerate(_chunkings(text, seed=len(text))):
        got, deltas, calls = stream(parser, chunks)
        assert got == (whole_content or ""), (i, chunks)
        assert names_args(calls) == names_args(whole_calls), (i, chunks)
        check_deltas(deltas, calls)


# A tool whose schema types GLM-4.5's and MiniMax-M2's text values.
TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "temp": {"type": "number"},
                    "hourly": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "unit": {"enum": ["c", "f"]},
                    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    }
]

# (parser, model text, expected arguments of its one call to get_weather), under TYPED_TOOLS
TYPED_CASES = [
    (  # a string keeps its text as written, spaces and digits included; others are JSON
        "glm45",
        glm(
            "get_weather",
            ("city", " Paris "),
            ("days", "5"),
            ("hourly", "true"),
            ("opts", '{"a": 1}'),
            ("tags", "['x', 'y']"),
        ),
        {"city": " Paris ", "days": 5, "hourly": True, "opts": {"a": 1}, "tags": ["x", "y"]},
    ),
    ("glm45", glm("get_weather", ("city", "5"), ("extra", "2.5")), {"city": "5", "extra": 2.5}),
    (
        "minimax_m2",
        minimax(
            invoke(
                "get_weather",
                ("city", " Paris "),
                ("days", "5"),
                ("temp", "21.5"),
                ("hourly", "yes"),
                ("opts", '{"a": [1]}'),
                ("tags", '["x"]'),
                ("unit", "c"),
                ("limit", "7"),
            )
        ),
        {
            "city": "Paris",
            "days": 5,
            "temp": 21.5,
            "hourly": True,
            "opts": {"a": [1]},
            "tags": ["x"],
            "unit": "c",
            "limit": 7,
        },
    ),
    (  # what does not read as its type falls back to JSON, then to the text
        "minimax_m2",
        minimax(
            invoke(
                "get_weather",
                ("days", "many"),
                ("temp", "20"),
                ("hourly", "maybe"),
                ("opts", "NaN"),
                ("limit", "null"),
                ("extra", "5"),
                ("city", "null"),  # vLLM's reading: null is null whatever the type
            )
        ),
        {
            "days": "many",
            "temp": 20,
            "hourly": "maybe",
            "opts": "NaN",
            "limit": None,
            "extra": "5",
            "city": None,
        },
    ),
]


@pytest.mark.parametrize(("parser", "text", "arguments"), TYPED_CASES)
def test_values_typed_by_the_tools_schema(parser, text, arguments):
    content, [call] = parse_tool_calls(parser, text, TYPED_TOOLS)
    assert content is None and call.name == "get_weather"
    assert json.loads(call.arguments) == arguments
    for i, chunks in enumerate(_chunkings(text, seed=len(text))):
        got, deltas, calls = stream(parser, chunks, TYPED_TOOLS)
        assert (got, names_args(calls)) == ("", [("get_weather", call.arguments)]), (i, chunks)
        check_deltas(deltas, calls)


def test_kimi_calls_keep_the_models_ids():
    text = KIMI_SEC + kimi("functions.get_weather:0", WEATHER) + kimi("search:1", "{}")
    _, calls = parse_tool_calls("kimi_k2", text)
    assert [c.id for c in calls] == ["functions.get_weather:0", "search:1"]
    _, deltas, streamed = stream("kimi_k2", list(text))
    assert [d.id for d in deltas] == ["functions.get_weather:0", "search:1"]
    assert streamed == calls


def test_nothing_that_may_be_a_call_is_sent_early():
    s = ToolCallStream("hermes")
    assert s.feed("Hello <tool") == ("Hello ", [])  # held: may be a marker
    assert s.feed("_call>\n") == ("", [])
    assert s.feed('{"name": "f", "arguments": {"a": ') == ("", [])
    assert s.feed("1}}\n</tool_call>")[1] == [ToolCallDelta(0, s.calls[0].id, "f", '{"a": 1}')]
    assert s.feed("\n") == ("", [])  # whitespace after a call: held, then dropped
    assert s.finish() == ("", [])
    plain = ToolCallStream("hermes")
    assert plain.feed("a <tool_") == ("a ", [])
    assert plain.feed("x") == ("<tool_x", [])  # not a marker after all


def test_ids():
    _, calls = parse_tool_calls("hermes", hermes("a", "{}") + hermes("b", "{}"))
    for call in calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    _, calls = parse_tool_calls("mistral", "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}")
    for call in calls:  # Mistral's chat templates reject any other id
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    assert calls[0].id != calls[1].id


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        ToolCallStream("gpt")
    with pytest.raises(ValueError):
        parse_tool_calls("nope", "x")


def test_feed_after_finish():
    s = ToolCallStream("hermes")
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")


# Random texts built from each family's pieces (markers, parts of markers, calls, broken
# calls, JSON punctuation, whitespace, unicode), cut at random points.
_COMMON = ["Hello", " ", "\n", "{", "}", '"', ":", ",", "[", "]", "é世🙂", "\\", "x", "{}"]
_PIECES = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "<",
        '{"name": "f", "arguments": ',
        '"name"',
        '"arguments"',
        hermes("g", NESTED),
        hermes("h", "{}"),
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[TOOL_",
        "[ARGS]",
        "[CALL_ID]",
        "get",
        '[{"name": "f", "arguments": {}}]',
        '{"name": "f", "arguments": ',
        f"[TOOL_CALLS]s[ARGS]{NESTED}",
    ],
    "deepseek": [
        DS_CALLS,
        DS_CALLS_END,
        DS_CALL,
        DS_END,
        DS_SEP,
        "function",
        "\n```json\n",
        "```",
        "<｜tool▁",
        deepseek("f", NESTED),
        DS_CALLS + deepseek("g", "{}"),
    ],
    "llama3_json": [
        "<|python_tag|>",
        "<tool_call>",
        "</tool_call>",
        "<|py",
        ";",
        '{"name": "f", "parameters": {}}',
        '{"name": "f", "arguments": ',
        f'{{"name": "s", "parameters": {NESTED}}}',
        '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
    ],
    "deepseek_v31": [
        DS_CALLS,
        DS_CALLS_END,
        DS_CALL,
        DS_END,
        DS_SEP,
        "get_weather",
        "<｜tool▁",
        v31("f", NESTED),
        DS_CALLS + v31("g", "{}"),
    ],
    "kimi_k2": [
        KIMI_SEC,
        KIMI_SEC_END,
        "<|tool_call_section_begin|>",
        KIMI_CALL,
        KIMI_ARGS,
        KIMI_END,
        "functions.f:0",
        "<|tool_",
        kimi("functions.s:1", NESTED),
        KIMI_SEC + kimi("g:0", "{}"),
    ],
    "glm45": [
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "get_weather",
        "<tool",
        glm("get_weather", ("city", " Paris "), ("days", "5"), ("hourly", "true")),
        glm("f", ("x", "[1, 'a']"), ("y", NESTED)),
    ],
    "minimax_m2": [
        MM_OPEN,
        MM_CLOSE,
        '<invoke name="f">',
        "</invoke>",
        "<parameter name=",
        "</parameter>",
        "<minimax:",
        MM_OPEN + invoke("get_weather", ("days", "5"), ("temp", "21.5"), ("unit", "c")),
        invoke("g", ("opts", NESTED), ("limit", "null")),
    ],
    # gpt-oss: its calls are harmony messages, read before the content reaches the family
    # (tests/service/test_reasoning_parsers.py): the content passes through untouched
    "openai": ["<|channel|>", "commentary to=functions.f", "<|message|>", "<|call|>", "<|"],
}


@st.composite
def texts_and_cuts(draw, parser):
    text = "".join(draw(st.lists(st.sampled_from(_PIECES[parser] + _COMMON), max_size=14)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=10))
    return text, sorted(set(cuts))


@pytest.mark.parametrize("parser", PARSERS)
def test_any_chunking_gives_the_whole_text_parse(parser):
    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(texts_and_cuts(parser))
    def check(case):
        text, cuts = case
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        whole_content, whole_calls = parse_tool_calls(parser, text, TYPED_TOOLS)
        got, deltas, calls = stream(parser, chunks, TYPED_TOOLS)
        assert got == (whole_content or "")
        assert names_args(calls) == names_args(whole_calls)
        check_deltas(deltas, calls)
        if not whole_calls and parser not in ("mistral", "llama3_json"):
            assert whole_content == (text or None)  # no call: the text is untouched

    check()


def test_long_arguments_stream_in_linear_time():
    import time

    args = json.dumps({"code": "def f(x):\n    return {'a': [x, \"}\"]}\n" * 500})
    text = hermes("run", args)
    start = time.perf_counter()
    _, deltas, calls = stream("hermes", list(text))  # ~19k one-character deltas
    assert time.perf_counter() - start < 2.0
    assert names_args(calls) == [("run", args)]
    check_deltas(deltas, calls)


# --- forced calls (tool_choice "required" or named) ------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
    {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {  # as pydantic writes a nested model
                "$defs": {
                    "Address": {
                        "type": "object",
                        "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
                        "required": ["street", "zip"],
                    }
                },
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
            },
        },
    },
]


def valid(schema: dict, text: str) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


def test_named_schema_is_the_functions_parameters():
    schema = forced_calls_schema(TOOLS, "get_weather")
    assert schema == TOOLS[0]["function"]["parameters"]
    assert schema is not TOOLS[0]["function"]["parameters"]  # a copy
    assert valid(schema, WEATHER)
    assert not valid(schema, '{"unit": "celsius"}')
    assert not valid(schema, '{"city": "Paris", "unit": "kelvin"}')
    assert forced_calls_schema(TOOLS, "now") == {"type": "object", "properties": {}}
    ship = forced_calls_schema(TOOLS, "ship")
    assert valid(ship, '{"to": {"street": "Rue de Rivoli", "zip": 75001}}')
    assert not valid(ship, '{"to": {"street": "Rue de Rivoli"}}')


def test_named_forced_output_to_calls():
    [call] = forced_calls(" " + WEATHER + "\n", "get_weather")
    assert (call.name, call.arguments) == ("get_weather", WEATHER)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    [call] = forced_calls("{}", "now", parser="mistral")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    for bad in ['{"city": "Par', "[1]", "{} {}", ""]:
        with pytest.raises(ValueError):
            forced_calls(bad, "get_weather")


def test_required_schema_validates_forced_output():
    schema = forced_calls_schema(TOOLS, None)
    good = (
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "now", "parameters": {{}}}},'
        ' {"name": "ship", "parameters": {"to": {"street": "Main St", "zip": 1}}}]'
    )
    assert valid(schema, good)
    for bad in [
        "[]",  # at least one call
        '[{"name": "get_weather", "parameters": {}}]',  # its required city
        '[{"name": "unknown", "parameters": {}}]',
        '[{"name": "now"}]',
        '[{"name": "now", "parameters": {}, "extra": 1}]',
        '[{"name": "ship", "parameters": {"to": {"street": "Main St"}}}]',  # through the $ref
        '{"name": "now", "parameters": {}}',
    ]:
        assert not valid(schema, bad), bad
    assert "$defs" in schema and "Address" in schema["$defs"]
    calls = forced_calls(good, None)
    assert names_args(calls) == [
        ("get_weather", WEATHER),
        ("now", "{}"),
        ("ship", '{"to": {"street": "Main St", "zip": 1}}'),
    ]
    assert len({c.id for c in calls}) == 3
    with pytest.raises(ValueError):
        forced_calls('[{"name": "now", "parameters": {}}', None)  # cut short


def test_forced_schema_errors():
    with pytest.raises(ValueError, match="missing"):
        forced_calls_schema(TOOLS, "missing")
    with pytest.raises(ValueError):
        forced_calls_schema([], None)
    with pytest.raises(ValueError):
        forced_calls_schema([{"type": "retrieval"}], None)
    clash = {
        "type": "function",
        "function": {
            "name": "other",
            "parameters": {"$defs": {"Address": {"type": "string"}}, "type": "object"},
        },
    }
    with pytest.raises(ValueError, match="Address"):
        forced_calls_schema([*TOOLS, clash], None)


# --- the parser each served architecture gets -----------------------------------------------

QWEN_TEMPLATE = (  # the tool part of Qwen2.5's / Qwen3's template
    "{%- if tools %}...<tools>...</tools>\\n\\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>"
    '\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)
MIXTRAL_8X22B_TEMPLATE = (
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
)
DEEPSEEK_TEMPLATE = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}"
)
LLAMA31_TEMPLATE = (
    "{%- if builtin_tools is defined or tool_call.name in builtin_tools %}"
    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}'
)
SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's, as its GGUF file carries it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEEPSEEK_V31_TEMPLATE = (  # the assistant tool calls of DeepSeek-V3.1's template
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)
KIMI_K2_TEMPLATE = (
    "{{render_content(message)}}<|tool_calls_section_begin|>{%- for tool_call in "
    "message['tool_calls'] -%}<|tool_call_begin|>{{ tool_call['id'] }}"
    "<|tool_call_argument_begin|>{{ tool_call['function']['arguments'] }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
)
GLM45_TEMPLATE = (
    "{{ '\\n<tool_call>' + tc.name }}{% for k, v in _args.items() %}\n<arg_key>{{ k }}"
    "</arg_key>\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
    "</arg_value>{% endfor %}\n</tool_call>"
)
MINIMAX_M2_TEMPLATE = (
    "{{- '<minimax:tool_call>' + '\\n' }}{%- for tool_call in message.tool_calls -%}"
    "{{- '<invoke name=\"' + tool_call.name + '\">' }}"
)
OLMOE_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("architecture", "template", "parser"),
    [
        ("MixtralForCausalLM", MIXTRAL_8X22B_TEMPLATE, "mistral"),
        ("MixtralForCausalLM", None, "mistral"),
        ("MistralForCausalLM", None, "mistral"),
        ("Qwen2MoeForCausalLM", QWEN_TEMPLATE, "hermes"),
        ("Qwen2MoeForCausalLM", None, "hermes"),
        ("Qwen3MoeForCausalLM", QWEN_TEMPLATE, "hermes"),
        ("Qwen2ForCausalLM", QWEN_TEMPLATE, "hermes"),
        ("OlmoeForCausalLM", OLMOE_TEMPLATE, "hermes"),
        ("DeepseekV2ForCausalLM", DEEPSEEK_TEMPLATE, "deepseek"),
        ("DeepseekV2ForCausalLM", None, "deepseek"),
        ("DeepseekV3ForCausalLM", DEEPSEEK_TEMPLATE, "deepseek"),
        ("DeepseekV3ForCausalLM", DEEPSEEK_V31_TEMPLATE, "deepseek_v31"),
        ("DeepseekV3ForCausalLM", KIMI_K2_TEMPLATE, "kimi_k2"),
        ("DeepseekV3ForCausalLM", None, "deepseek"),
        ("Glm4MoeForCausalLM", GLM45_TEMPLATE, "glm45"),
        ("Glm4MoeForCausalLM", None, "glm45"),
        ("Glm4MoeForCausalLM", QWEN_TEMPLATE, "hermes"),  # a ChatML template (the demo's)
        ("MiniMaxM2ForCausalLM", MINIMAX_M2_TEMPLATE, "minimax_m2"),
        ("MiniMaxM2ForCausalLM", None, "minimax_m2"),
        ("LlamaForCausalLM", LLAMA31_TEMPLATE, "llama3_json"),
        ("LlamaForCausalLM", SMOLLM2_TEMPLATE, "llama3_json"),
        ("LlamaForCausalLM", None, "llama3_json"),
        ("SomethingNewForCausalLM", None, "hermes"),
    ],
)
def test_parser_for(architecture, template, parser):
    assert parser_for(architecture, template) == parser
    assert parser in PARSERS
