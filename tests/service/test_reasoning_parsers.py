"""Reasoning parsers: canned outputs of each family split whole and streamed at every split
point and over random chunkings (the same reasoning, content and calls every way), the parser
`auto` gives each architecture, and the per-choice parse that hands the content on to the
tool-call parsers (gpt-oss's harmony calls under the `openai` tool-call parser)."""

from __future__ import annotations

import json
import random

import pytest

from service.errors import BadRequest
from service.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    new_reasoning_stream,
    parse_reasoning,
    reasoning_parser_for,
)
from service.reasoning import ChoiceParse, ReasoningPlan, enable_in_reasoning, reasoning_plan
from service.tools import tool_plan

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_CALL = "<|end|>", "<|call|>"


def harmony(channel: str, text: str, recipient: str | None = None, first: bool = False) -> str:
    """One assistant message in harmony (the prompt ends with `<|start|>assistant`, so the
    first message of a completion has no start)."""
    head = "" if first else f"{H_START}assistant"
    to = f" to={recipient} <|constrain|>json" if recipient else ""
    return f"{head}{H_CHANNEL}{channel}{to}{H_MESSAGE}{text}"


ANALYSIS = harmony("analysis", "The user wants the weather. Use get_weather.", first=True)

# (parser, model text, expected reasoning, expected content)
CASES = [
    # DeepSeek-R1: the template opened <think>, the output starts inside it
    (
        "deepseek_r1",
        "Let me think: 2+2=4.\n</think>\n\nThe answer is 4.",
        "Let me think: 2+2=4.\n",
        "\n\nThe answer is 4.",
    ),
    (
        "deepseek_r1",
        "<think>\nok, a < b and </thin are text\n</think>Yes.",
        "\nok, a < b and </thin are text\n",
        "Yes.",
    ),
    ("deepseek_r1", "  <think>x</think>", "x", None),  # written <think> after whitespace dropped
    ("deepseek_r1", "cut short before the end", "cut short before the end", None),
    ("deepseek_r1", "</think>straight to the answer", None, "straight to the answer"),
    ("deepseek_r1", "é 世界 🙂</think>🙂 <think> stays", "é 世界 🙂", "🙂 <think> stays"),
    # MiniMax-M2: no <think> written, only </think>
    ("minimax_m2", "Reasoning.</think>Answer.", "Reasoning.", "Answer."),
    ("minimax_m2", "<think>Reasoning.</think>\nAnswer.", "Reasoning.", "\nAnswer."),
    # GLM-4.5: the model opens the block; without it all is content
    ("glm45", "<think>Check the units.</think>42 km", "Check the units.", "42 km"),
    ("glm45", "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    ("glm45", "\n<think>cut short", "cut short", "\n"),
    (
        "glm45",
        "<think></think>Answer <think>not again</think>",
        None,
        "Answer <think>not again</think>",
    ),
    ("glm45", "a <thin b < c", None, "a <thin b < c"),
    # gpt-oss: harmony channels
    (
        "gpt_oss",
        ANALYSIS + H_END + harmony("final", "It is sunny in Paris."),
        "The user wants the weather. Use get_weather.",
        "It is sunny in Paris.",
    ),
    (
        "gpt_oss",
        harmony("final", "Just the answer.", first=True) + "<|return|>",
        None,
        "Just the answer.",
    ),
    (
        "gpt_oss",
        ANALYSIS
        + H_END
        + harmony("analysis", "And more.")
        + H_END
        + harmony("commentary", "Checking.")
        + H_END
        + harmony("final", "Done é🙂."),
        "The user wants the weather. Use get_weather.\nAnd more.",
        "Checking.\nDone é🙂.",
    ),
    ("gpt_oss", ANALYSIS, "The user wants the weather. Use get_weather.", None),  # cut short
    ("gpt_oss", "plain text, not harmony", None, "plain text, not harmony"),
    # harmony refuses text after a message: from there on all is content, verbatim
    (
        "gpt_oss",
        ANALYSIS + H_END + "stray text" + harmony("final", "Fine."),
        "The user wants the weather. Use get_weather.",
        "stray text" + harmony("final", "Fine."),
    ),
]
CALL_TEXT = ANALYSIS + H_END + harmony("commentary", WEATHER_ARGS, "functions.get_weather") + H_CALL
TWO_CALLS = (
    ANALYSIS
    + H_END
    + harmony("commentary", WEATHER_ARGS, "functions.get_weather")
    + H_CALL
    + harmony("commentary", '{"zone": "UTC"}', "functions.get_time")
)


def _stream(parser: str, chunks: list[str]) -> tuple[str | None, str | None, tuple]:
    stream = new_reasoning_stream(parser)
    total = ReasoningDelta()
    for chunk in chunks:
        total = total + stream.feed(chunk)
    total = total + stream.finish()
    return total.reasoning or None, total.content or None, total.calls


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_text(parser, text, reasoning, content):
    assert parse_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_every_split_gives_the_whole_text_parse(parser, text, reasoning, content):
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]])[:2] == (reasoning, content), i


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_random_chunkings_give_the_whole_text_parse(parser, text, reasoning, content):
    rng = random.Random(hash((parser, text)) & 0xFFFF)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _stream(parser, chunks)[:2] == (reasoning, content), chunks


def test_character_by_character():
    for parser, text, reasoning, content in CASES:
        assert _stream(parser, list(text))[:2] == (reasoning, content), (parser, text)


def test_a_marker_split_across_chunks_never_leaks():
    """What goes out while a marker is incomplete is never part of it."""
    text = "abc</think>def"
    stream = new_reasoning_stream("deepseek_r1")
    sent = [stream.feed(c) for c in ("abc</", "thi", "nk", ">d", "ef")]
    assert [d.reasoning for d in sent] == ["abc", "", "", "", ""]
    assert [d.content for d in sent] == ["", "", "", "d", "ef"]
    assert stream.finish() == ReasoningDelta()
    assert parse_reasoning("deepseek_r1", text) == ("abc", "def")
    harmony_stream = new_reasoning_stream("gpt_oss")
    out = [harmony_stream.feed(c) for c in ("<|chan", "nel|>analysis<|mess", "age|>hm<", "|end|>")]
    assert "".join(d.reasoning for d in out) == "hm"
    assert all("<|" not in d.reasoning + d.content for d in out)


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (CALL_TEXT, [("get_weather", WEATHER_ARGS)]),
        (TWO_CALLS, [("get_weather", WEATHER_ARGS), ("get_time", '{"zone": "UTC"}')]),
    ],
)
def test_harmony_tool_calls_at_every_split(text, calls):
    for i in range(len(text) + 1):
        reasoning, content, got = _stream("gpt_oss", [text[:i], text[i:]])
        assert reasoning == "The user wants the weather. Use get_weather."
        assert content is None
        assert list(got) == calls, i


def test_harmony_recipient_in_the_role_header():
    """gpt-oss may name the recipient before the channel (`<|start|>assistant to=...`)."""
    text = (
        ANALYSIS + H_END + f"{H_START}assistant to=functions.get_weather{H_CHANNEL}commentary "
        f"json{H_MESSAGE}{WEATHER_ARGS}{H_CALL}"
    )
    assert _stream("gpt_oss", [text])[2] == (("get_weather", WEATHER_ARGS),)


def test_feed_after_finish():
    for parser in REASONING_PARSERS:
        stream = new_reasoning_stream(parser)
        stream.finish()
        with pytest.raises(RuntimeError):
            stream.feed("x")
        with pytest.raises(RuntimeError):
            stream.finish()


CHATML = "{{ '<|im_start|>assistant\n' }}"


@pytest.mark.parametrize(
    ("architecture", "template", "parser"),
    [
        ("DeepseekV3ForCausalLM", "{{ '<｜Assistant｜><think>\\n' }}", "deepseek_r1"),  # R1
        ("DeepseekV3ForCausalLM", "{{ '<｜Assistant｜>' }}", None),  # V3: no thinking
        ("DeepseekV3ForCausalLM", None, None),
        ("GptOssForCausalLM", None, "gpt_oss"),  # harmony renders its prompts
        ("GptOssForCausalLM", "<|start|>assistant<|channel|>final<|message|>", "gpt_oss"),
        ("GptOssForCausalLM", CHATML, None),  # a demo checkpoint
        ("Glm4MoeForCausalLM", "<|assistant|>{{ '<think></think>' }}", "glm45"),
        ("Glm4MoeForCausalLM", CHATML, None),
        ("MiniMaxM2ForCausalLM", "]~b]ai\n<think>\n", "minimax_m2"),
        ("MiniMaxM2ForCausalLM", CHATML, None),
        ("MixtralForCausalLM", "<think>", None),
        ("Qwen3MoeForCausalLM", None, None),
    ],
)
def test_auto(architecture, template, parser):
    assert reasoning_parser_for(architecture, template) == parser


def test_structured_outputs_config():
    assert enable_in_reasoning(None) is False
    assert enable_in_reasoning('{"enable_in_reasoning": true}') is True
    for bad in ("{", '{"backend": "xgrammar"}', '{"enable_in_reasoning": 1}', "[]"):
        with pytest.raises(ValueError, match="structured-outputs-config"):
            enable_in_reasoning(bad)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


def _choice(reasoning, tools, chunks):
    parse = ChoiceParse(reasoning, tools)
    pieces = [parse.feed(c) for c in chunks] + [parse.finish()]
    return (
        "".join(p.reasoning for p in pieces),
        "".join(p.content for p in pieces),
        [d for p in pieces for d in p.tool_calls],
        parse,
    )


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    """The hermes call inside the reasoning is thought, not a call."""
    text = (
        'Maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>?</think>Sure.'
        '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>"
    )
    plan = tool_plan([WEATHER_TOOL, TIME_TOOL], "auto", None, None, "hermes")
    for i in range(len(text) + 1):
        reasoning, content, deltas, parse = _choice(
            ReasoningPlan("deepseek_r1"), plan, [text[:i], text[i:]]
        )
        assert reasoning.startswith("Maybe <tool_call>") and content == "Sure."
        assert [(d.name, d.arguments) for d in deltas] == [("get_weather", WEATHER_ARGS)]
        assert [c.name for c in parse.calls] == ["get_weather"]
        assert parse.finish_reason("stop") == "tool_calls"


def test_the_openai_tool_parser_reports_harmony_calls():
    plan = tool_plan([WEATHER_TOOL, TIME_TOOL], "auto", None, None, "openai")
    for i in range(0, len(TWO_CALLS) + 1, 7):
        reasoning, content, deltas, parse = _choice(
            ReasoningPlan("gpt_oss"), plan, [TWO_CALLS[:i], TWO_CALLS[i:]]
        )
        assert reasoning == "The user wants the weather. Use get_weather." and content == ""
        assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [
            (0, "get_weather", json.loads(WEATHER_ARGS)),
            (1, "get_time", {"zone": "UTC"}),
        ]
        assert [d.id for d in deltas] == [c.id for c in parse.calls]
        assert parse.finish_reason("stop") == "tool_calls"
    # no reasoning parser: the calls are still read, the analysis is not shown
    reasoning, content, deltas, _ = _choice(None, plan, [CALL_TEXT])
    assert (reasoning, content, [d.name for d in deltas]) == ("", "", ["get_weather"])
    # one call only without parallel_tool_calls; none under tool_choice "none"
    single = tool_plan([WEATHER_TOOL, TIME_TOOL], "auto", None, False, "openai")
    assert len(_choice(ReasoningPlan("gpt_oss"), single, [TWO_CALLS])[3].calls) == 1
    none = tool_plan([WEATHER_TOOL], "none", None, None, "openai")
    assert _choice(ReasoningPlan("gpt_oss"), none, [CALL_TEXT])[3].calls == []


def test_a_prompt_that_closes_the_reasoning_leaves_all_to_the_answer(tiny_model_dir):
    """A template with thinking off writes the end marker into the prompt (GLM-4.5's
    `<think></think>`, DeepSeek-V3.1's `</think>`): no reasoning plan, all output is answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def plan(parser, prompt):
        return reasoning_plan(parser, tokenizer, tokenizer.encode(prompt))

    assert plan("deepseek_r1", "<|im_start|>assistant\n<think>\n") == ReasoningPlan("deepseek_r1")
    assert plan("deepseek_r1", "<|im_start|>assistant\n</think>") is None
    assert plan("glm45", "<|assistant|><think></think>\n") is None
    assert plan("gpt_oss", "<|start|>assistant") == ReasoningPlan("gpt_oss")
    assert plan(None, "anything") is None


def test_flags(capsys):
    import argparse

    from service.settings import add_arguments, from_namespace

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_namespace(parser.parse_args([])).reasoning_parser == "auto"
    config = '{"enable_in_reasoning": true}'
    args = ["--reasoning-parser", "none", "--structured-outputs-config", config]
    settings = from_namespace(parser.parse_args(args))
    assert (settings.reasoning_parser, settings.structured_outputs_config) == ("none", config)
    for bad in (["--reasoning-parser", "qwen3"], ["--structured-outputs-config", "{"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "structured-outputs-config is not JSON" in capsys.readouterr().err


def test_gpt_oss_prompts_are_rendered_by_harmony(tiny_model_dir):
    """Where the tokenizer is gpt-oss's, harmony renders the chat (the demo tokenizer is not)."""
    from transformers import AutoTokenizer

    from service.harmony_prompt import is_harmony_tokenizer, render_harmony
    from service.parsers.harmony import harmony_encoding

    assert not is_harmony_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    ]
    text = harmony_encoding().decode(render_harmony(messages, [tool]))
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "type get_weather = " in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    ) in text
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}'
    ) in text
    with pytest.raises(BadRequest, match="tool_call_id"):
        render_harmony([{"role": "tool", "content": "x", "tool_call_id": "nope"}], None)


def test_a_forced_call_is_read_from_the_answer_after_the_reasoning():
    """tool_choice "required": the grammar forces the answer (after </think>) into the calls'
    JSON; the reasoning before it is reasoning, at every split."""
    text = (
        'Paris, so get_weather.</think>[{"name": "get_weather", "parameters": '
        + WEATHER_ARGS
        + "}]"
    )
    plan = tool_plan([WEATHER_TOOL], "required", None, None, "hermes")
    for i in range(len(text) + 1):
        reasoning, content, deltas, parse = _choice(
            ReasoningPlan("deepseek_r1"), plan, [text[:i], text[i:]]
        )
        assert (reasoning, content) == ("Paris, so get_weather.", "")
        assert [(c.name, json.loads(c.arguments)) for c in parse.calls] == [
            ("get_weather", json.loads(WEATHER_ARGS))
        ]
        assert [d.name for d in deltas] == ["get_weather"]
