"""Tool calls in a model's own syntax: one parser per model family, whole text or streamed.

`parse_tool_calls(parser, text)` splits a finished completion into content and calls;
`ToolCallStream(parser)` does the same over the deltas of a streamed one (`feed` per delta,
`finish` at the end). The whole-text parse is the stream fed the text at once, and the
stream decides nothing before the text it has seen settles it, so any chunking of a text
gives the same content and the same calls.

Families (`PARSERS`; `parser_for` picks one from a checkpoint):
  - "hermes" (Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE; the demo model): `<tool_call>` JSON
    `{"name": ..., "arguments": {...}}` `</tool_call>`, one block per call (the format the
    Qwen2.5/Qwen3 chat templates teach; vLLM's and SGLang's "hermes"/"qwen25" parsers).
  - "mistral" (Mixtral, Mistral): `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`
    objects (tokenizers v2-v7: Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3; an "id"
    member may be present), or `[TOOL_CALLS]name[ARGS]{...}` and
    `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (v11+), as mistral-common decodes them.
  - "deepseek" (DeepSeek-V2/V2.5/V3): `<｜tool▁calls▁begin｜>` then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
    (separated by newlines) and `<｜tool▁calls▁end｜>` (the V2.5/V3 chat templates; vLLM's
    and SGLang's deepseekv3 parsers); the V3.1 form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`
    `<｜tool▁call▁end｜>` is read too.
  - "llama3_json" (Llama 3.x, SmolLM2): a JSON object `{"name": ..., "parameters"|"arguments":
    {...}}` that opens the output (or a segment after a call), optionally after
    `<|python_tag|>`, several separated by `;` (vLLM's llama3_json); and SmolLM2's
    `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` (the function-calling
    format of SmolLM2-Instruct's model card and Ollama template; a single object in the block
    is read too).

Rules common to all families:
  - a call is a JSON object with a non-empty string "name" and an object of arguments
    ("arguments", or "parameters" where the family uses it; an object encoded as a JSON
    string is accepted); other members (such as Mistral's "id") are ignored. `arguments` is
    the arguments object's JSON text as the model wrote it. A call is emitted only once it
    is complete, so a streamed call is one delta carrying its id, name and whole arguments:
    nothing is sent that a later character could prove not to be a call.
  - text that starts like a call but does not parse stays content, byte for byte; parsing
    starts again right after the marker, so a later well-formed call is still found.
  - a missing closing marker at the very end of the text (the output stopped there) is
    accepted once the arguments object is complete.
  - content is the text outside the calls, verbatim, except that whitespace-only stretches
    between, before or after calls are dropped; text with no call comes back unchanged.
  - ids are "call_" + 24 random letters and digits (as OpenAI's), except for Mistral, whose
    chat templates and mistral-common require 9 letters and digits (as vLLM's mistral parser).

The markers of Mistral (`[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`) and Llama (`<|python_tag|>`)
are special tokens: the text given here must be decoded with them kept.

For `tool_choice` "required" or a named function the output is forced by a grammar instead:
`forced_calls_schema(tools, name)` is the JSON schema it must match (as vLLM forces it) and
`forced_calls(text, name)` reads such output into calls.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import string
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "forced_calls",
    "forced_calls_schema",
    "parse_tool_calls",
    "parser_for",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One item of an OpenAI streaming `delta.tool_calls`: id and name on a call's first
    delta, argument text after (here a call's one delta carries all three)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# --- resumable parsing over a growing text ------------------------------------------------
#
# A parser is a generator over a _Src: it reads src.text from src.pos on, and where the text
# seen so far does not settle what comes next it yields, to be resumed with more text
# appended (src.final says no more will come). It returns its result, or raises _Fail where
# the text cannot be the syntax it parses.

T = TypeVar("T")
_Parse = Generator[None, None, T]


class _Fail(Exception):
    """The text at the cursor is not the syntax being parsed."""


class _Src:
    __slots__ = ("final", "pos", "text")

    def __init__(self, text: str, final: bool) -> None:
        self.text = text
        self.pos = 0
        self.final = final


def _more(src: _Src) -> _Parse[bool]:
    """Waits for a character at the cursor; False at the end of the text."""
    while src.pos >= len(src.text):
        if src.final:
            return False
        yield
    return True


def _peek(src: _Src) -> _Parse[str | None]:
    if not (yield from _more(src)):
        return None
    return src.text[src.pos]


_WS = re.compile(r"[ \t\r\n]*")


def _ws(src: _Src) -> _Parse[None]:
    """Skips JSON whitespace (waiting to see what follows it)."""
    while (yield from _more(src)):
        src.pos = _WS.match(src.text, src.pos).end()
        if src.pos < len(src.text):
            return


def _choose(src: _Src, options: tuple[str, ...], end_ok: bool = False) -> _Parse[str]:
    """Consumes the one of `options` the text continues with; with end_ok the end of the text
    (after the start of an option, or nothing) is accepted too and returns ""."""
    longest = max(map(len, options))
    while True:
        have = src.text[src.pos : src.pos + longest]
        for option in options:
            if have.startswith(option):
                src.pos += len(option)
                return option
        if not any(option.startswith(have) for option in options):
            raise _Fail
        if src.final:
            if end_ok:
                src.pos = len(src.text)
                return ""
            raise _Fail
        yield


def _lit(src: _Src, literal: str, end_ok: bool = False) -> _Parse[None]:
    yield from _choose(src, (literal,), end_ok)


def _at_end(src: _Src) -> _Parse[bool]:
    return not (yield from _more(src))


_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def _name(src: _Src) -> _Parse[str]:
    """A bare function name (letters, digits, `_.-`)."""
    start = src.pos
    while True:
        src.pos = _NAME.match(src.text, src.pos).end()
        if src.pos < len(src.text) or src.final:
            break
        yield
    if src.pos == start:
        raise _Fail
    return src.text[start : src.pos]


# JSON (RFC 8259), validated as it arrives so that a broken call fails where it breaks.

_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_RUN = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_MAX_DEPTH = 64
_Span = tuple[int, int]


def _wait_for(src: _Src, n: int) -> _Parse[None]:
    """Waits until n characters are at the cursor."""
    while len(src.text) - src.pos < n:
        if src.final:
            raise _Fail
        yield


def _string(src: _Src) -> _Parse[None]:
    src.pos += 1  # the opening quote
    while True:
        src.pos = _STRING_RUN.match(src.text, src.pos).end()
        if src.pos == len(src.text):
            if src.final:
                raise _Fail
            yield
            continue
        c = src.text[src.pos]
        if c == '"':
            src.pos += 1
            return
        if c != "\\":  # a raw control character
            raise _Fail
        yield from _wait_for(src, 2)
        escape = src.text[src.pos + 1]
        if escape in '"\\/bfnrt':
            src.pos += 2
        elif escape == "u":
            yield from _wait_for(src, 6)
            if not _HEX4.fullmatch(src.text, src.pos + 2, src.pos + 6):
                raise _Fail
            src.pos += 6
        else:
            raise _Fail


def _number(src: _Src) -> _Parse[None]:
    start = src.pos
    while True:
        end = _NUMBER_RUN.match(src.text, start).end()
        if end < len(src.text) or src.final:
            break
        yield
    if not _NUMBER.fullmatch(src.text, start, end):
        raise _Fail
    src.pos = end


def _object(src: _Src, depth: int, members: dict[str, _Span] | None) -> _Parse[None]:
    src.pos += 1  # {
    yield from _ws(src)
    if (yield from _peek(src)) == "}":
        src.pos += 1
        return
    while True:
        yield from _ws(src)
        if (yield from _peek(src)) != '"':
            raise _Fail
        key_start = src.pos
        yield from _string(src)
        key_end = src.pos
        yield from _ws(src)
        yield from _lit(src, ":")
        span = yield from _value(src, depth + 1)
        if members is not None:
            members[json.loads(src.text[key_start:key_end])] = span
        yield from _ws(src)
        c = yield from _peek(src)
        src.pos += 1
        if c == "}":
            return
        if c != ",":
            raise _Fail


def _array(src: _Src, depth: int) -> _Parse[None]:
    src.pos += 1  # [
    yield from _ws(src)
    if (yield from _peek(src)) == "]":
        src.pos += 1
        return
    while True:
        yield from _value(src, depth + 1)
        yield from _ws(src)
        c = yield from _peek(src)
        src.pos += 1
        if c == "]":
            return
        if c != ",":
            raise _Fail


def _value(src: _Src, depth: int = 0, members: dict[str, _Span] | None = None) -> _Parse[_Span]:
    """One JSON value after optional whitespace; its span. With `members`, an object's
    member spans are recorded there (the last of a repeated key wins, as in json.loads)."""
    if depth > _MAX_DEPTH:
        raise _Fail
    yield from _ws(src)
    c = yield from _peek(src)
    start = src.pos
    if c == "{":
        yield from _object(src, depth, members)
    elif c == "[":
        yield from _array(src, depth)
    elif c == '"':
        yield from _string(src)
    elif c is not None and c in "-0123456789":
        yield from _number(src)
    elif c == "t":
        yield from _lit(src, "true")
    elif c == "f":
        yield from _lit(src, "false")
    elif c == "n":
        yield from _lit(src, "null")
    else:
        raise _Fail
    return start, src.pos


def _object_text(src: _Src) -> _Parse[str]:
    """A JSON object (after optional whitespace); its text."""
    yield from _ws(src)
    if (yield from _peek(src)) != "{":
        raise _Fail
    start, end = yield from _value(src)
    return src.text[start:end]


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _arguments(raw: str) -> str:
    """The arguments' JSON text: an object, or a JSON string holding an object's text."""
    value = json.loads(raw)
    if isinstance(value, str):
        raw = value.strip()
        try:
            value = json.loads(raw, parse_constant=_strict_constant)
        except ValueError:
            raise _Fail from None
    if not isinstance(value, dict):
        raise _Fail
    return raw


_Call = tuple[str, str]  # name, arguments


def _call_object(src: _Src, arg_keys: tuple[str, ...]) -> _Parse[_Call]:
    """`{"name": ..., <one of arg_keys>: {...}, ...}` (after optional whitespace)."""
    yield from _ws(src)
    if (yield from _peek(src)) != "{":
        raise _Fail
    members: dict[str, _Span] = {}
    yield from _value(src, 0, members)
    if "name" not in members:
        raise _Fail
    name = json.loads(src.text[slice(*members["name"])])
    present = [key for key in arg_keys if key in members]
    if not isinstance(name, str) or not name or len(present) != 1:
        raise _Fail
    return name, _arguments(src.text[slice(*members[present[0]])])


def _call_list(src: _Src, arg_keys: tuple[str, ...]) -> _Parse[list[_Call]]:
    """A JSON array of call objects (after optional whitespace)."""
    yield from _ws(src)
    if (yield from _peek(src)) != "[":
        raise _Fail
    src.pos += 1
    calls: list[_Call] = []
    yield from _ws(src)
    if (yield from _peek(src)) == "]":
        src.pos += 1
        return calls
    while True:
        calls.append((yield from _call_object(src, arg_keys)))
        yield from _ws(src)
        c = yield from _peek(src)
        src.pos += 1
        if c == "]":
            return calls
        if c != ",":
            raise _Fail


# --- the families -------------------------------------------------------------------------
#
# A family's `unit` parses from one of its markers and returns (calls, more): with more, its
# `more` parser runs next, on the text after the unit (the next call of a block, or its end).

_Unit = Callable[[_Src], _Parse[tuple[list[_Call], bool]]]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _hermes_unit(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    yield from _lit(src, HERMES_OPEN)
    call = yield from _call_object(src, ("arguments",))
    yield from _ws(src)
    yield from _lit(src, HERMES_CLOSE, end_ok=True)
    return [call], False


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_unit(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    yield from _lit(src, MISTRAL_CALLS)
    yield from _ws(src)
    if (yield from _peek(src)) == "[":  # tokenizers v2-v7: a JSON list of calls
        return (yield from _call_list(src, ("arguments",))), False
    name = yield from _name(src)  # v11+: name[ARGS]{...} or name[CALL_ID]id[ARGS]{...}
    if (yield from _choose(src, (MISTRAL_ARGS, MISTRAL_CALL_ID))) == MISTRAL_CALL_ID:
        yield from _name(src)  # the model's own call id; ours replaces it
        yield from _lit(src, MISTRAL_ARGS)
    return [(name, (yield from _object_text(src)))], False


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def _deepseek_call(src: _Src) -> _Parse[_Call]:
    """One call after its <｜tool▁call▁begin｜>."""
    first = yield from _name(src)
    yield from _lit(src, DS_SEP)
    if (yield from _peek(src)) == "{":  # V3.1: NAME<sep>{...}
        name, args = first, (yield from _object_text(src))
    else:  # V2, V2.5, V3: function<sep>NAME\n```json\n{...}\n```
        if first != "function":
            raise _Fail
        name = yield from _name(src)
        yield from _ws(src)
        yield from _lit(src, "```json")
        args = yield from _object_text(src)
        yield from _ws(src)
        yield from _lit(src, "```", end_ok=True)
    yield from _ws(src)
    yield from _lit(src, DS_CALL_END, end_ok=True)
    return name, args


def _deepseek_unit(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    yield from _lit(src, DS_CALLS_BEGIN)
    yield from _ws(src)
    yield from _lit(src, DS_CALL_BEGIN)
    return [(yield from _deepseek_call(src))], True


def _deepseek_more(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    yield from _ws(src)
    if (yield from _choose(src, (DS_CALL_BEGIN, DS_CALLS_END), end_ok=True)) != DS_CALL_BEGIN:
        return [], False
    return [(yield from _deepseek_call(src))], True


LLAMA_PYTHON_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("arguments", "parameters")


def _llama_unit(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    # The unit starts at one of its markers, complete: <tool_call>, <|python_tag|> or {.
    if src.text.startswith(HERMES_OPEN):  # SmolLM2: <tool_call>[{...}, ...]</tool_call>
        src.pos = len(HERMES_OPEN)
        yield from _ws(src)
        if (yield from _peek(src)) == "[":
            calls = yield from _call_list(src, _LLAMA_KEYS)
        else:
            calls = [(yield from _call_object(src, _LLAMA_KEYS))]
        yield from _ws(src)
        yield from _lit(src, HERMES_CLOSE, end_ok=True)
        return calls, False
    if src.text.startswith(LLAMA_PYTHON_TAG):
        src.pos = len(LLAMA_PYTHON_TAG)
    return [(yield from _call_object(src, _LLAMA_KEYS))], True


def _llama_more(src: _Src) -> _Parse[tuple[list[_Call], bool]]:
    yield from _ws(src)
    if (yield from _at_end(src)):
        return [], False
    yield from _lit(src, ";")
    return [(yield from _call_object(src, _LLAMA_KEYS))], True


@dataclass(frozen=True, slots=True)
class _Family:
    markers: tuple[str, ...]  # where a call may start, anywhere in the text
    unit: _Unit
    more: _Unit | None = None
    bare_json: bool = False  # a "{" opening the output or a segment after a call starts one
    short_ids: bool = False  # 9-character ids (Mistral)


_FAMILIES: dict[str, _Family] = {
    "hermes": _Family((HERMES_OPEN,), _hermes_unit),
    "mistral": _Family((MISTRAL_CALLS,), _mistral_unit, short_ids=True),
    "deepseek": _Family((DS_CALLS_BEGIN,), _deepseek_unit, _deepseek_more),
    "llama3_json": _Family((HERMES_OPEN, LLAMA_PYTHON_TAG), _llama_unit, _llama_more, True),
}
PARSERS: tuple[str, ...] = tuple(_FAMILIES)

_ALNUM = string.ascii_letters + string.digits


def _new_id(short: bool) -> str:
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_call_id(parser: str) -> str:
    """A fresh tool-call id in `parser`'s family's form (Mistral's are 9 characters)."""
    return _new_id(_family(parser).short_ids)


def _family(parser: str) -> _Family:
    try:
        return _FAMILIES[parser]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {parser!r}; choose from {', '.join(PARSERS)}"
        ) from None


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker."""
    held = 0
    for m in markers:
        i = text.find(m[0], max(0, len(text) - len(m) + 1))
        while i != -1:
            if m.startswith(text[i:]):
                held = max(held, len(text) - i)
                break
            i = text.find(m[0], i + 1)
    return held


class ToolCallStream:
    """Tool calls of one streamed choice: `feed` each text delta, then `finish`.

    Each returns the content to send now and the tool-call deltas to send now. Text that
    may still turn out to be (part of) a call is held back until that is settled; `calls`
    holds the complete calls so far, with the ids their deltas carried.
    """

    def __init__(self, parser: str) -> None:
        self._family = _family(parser)
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet sent as content: a possible start of a marker
        self._ws = ""  # whitespace held while the current segment has nothing else
        self._in_text = False  # the current segment (since the last call) has other text
        self._after_call = False  # a call block has been read
        self._unit: Generator | None = None  # the parser running over self._src
        self._src: _Src | None = None
        self._marker: str | None = None  # the marker it started at (None: a `more` parser)
        self._done = False

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        if self._unit is not None:
            self._src.text += delta_text
        else:
            self._pending += delta_text
        return self._run()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        if self._src is not None:
            self._src.final = True
        content, deltas = self._run()
        if self._ws and not self._after_call:  # whitespace and nothing else
            content += self._ws
        self._ws = ""
        return content, deltas

    def _run(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._unit is None:
                if not self._scan_text(content):
                    break
                continue
            try:
                self._unit.send(None)
                break  # waiting for more text
            except StopIteration as stop:
                calls, more = stop.value
                self._take(calls, deltas)
                rest = self._src.text[self._src.pos :]
                if more:
                    self._start(rest, None)
                else:
                    self._unit = self._src = None
                    self._pending = rest
            except _Fail:
                text = self._src.text
                self._unit = self._src = None
                if self._marker is not None:  # not a call after all: the marker is content
                    self._emit(self._marker, content)
                    text = text[len(self._marker) :]
                self._pending = text
        return "".join(content), deltas

    def _scan_text(self, content: list[str]) -> bool:
        """Sends content up to the next call marker and starts parsing there (True), or
        sends what cannot start a marker and holds the rest (False)."""
        text, family = self._pending, self._family
        at, marker = -1, None
        for m in family.markers:
            i = text.find(m)
            if i >= 0 and (at < 0 or i < at):
                at, marker = i, m
        if family.bare_json and not self._in_text:
            j = len(text) - len(text.lstrip())
            if j < len(text) and text[j] == "{" and (at < 0 or j < at):
                at, marker = j, "{"
        if marker is not None:
            self._emit(text[:at], content)
            self._pending = ""
            self._start(text[at:], marker)
            return True
        keep = 0 if self._done else _held_suffix(text, family.markers)
        self._emit(text[: len(text) - keep], content)
        self._pending = text[len(text) - keep :]
        return False

    def _start(self, text: str, marker: str | None) -> None:
        self._src = _Src(text, self._done)
        self._marker = marker
        parse = self._family.unit if marker is not None else self._family.more
        self._unit = parse(self._src)

    def _emit(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if not self._in_text:
            if text.isspace():  # held: dropped if a call follows, sent if other text does
                self._ws += text
                return
            text, self._ws, self._in_text = self._ws + text, "", True
        content.append(text)

    def _take(self, calls: list[_Call], deltas: list[ToolCallDelta]) -> None:
        self._ws, self._in_text, self._after_call = "", False, True
        for name, arguments in calls:
            call = ToolCall(_new_id(self._family.short_ids), name, arguments)
            deltas.append(ToolCallDelta(len(self.calls), call.id, name, arguments))
            self.calls.append(call)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, None if there is none; the calls) of a whole text."""
    stream = ToolCallStream(parser)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    return (content + rest) or None, stream.calls


# The family a checkpoint's outputs follow, by architecture where its chat template names
# no tool-call syntax (templates are checked first: a ChatML demo Mixtral speaks hermes).
_ARCH_PARSERS = {
    "MixtralForCausalLM": "mistral",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "LlamaForCausalLM": "llama3_json",
}


def parser_for(architecture: str, chat_template: str | None) -> str:
    """The default tool-call parser for a checkpoint of `architecture` (its config's
    `architectures[0]`) with `chat_template`; "hermes" where nothing says otherwise (OLMoE's
    templates have no tool syntax)."""
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if DS_CALLS_BEGIN in template or DS_CALL_BEGIN in template:
        return "deepseek"
    if LLAMA_PYTHON_TAG in template:
        return "llama3_json"
    if HERMES_OPEN in template:  # Llama-architecture ChatML models (SmolLM2) list calls
        return "llama3_json" if architecture == "LlamaForCausalLM" else "hermes"
    return _ARCH_PARSERS.get(architecture, "hermes")


# --- forced tool calls (tool_choice "required" or a named function) -------------------------

_NO_PARAMETERS = {"type": "object", "properties": {}}


def _functions(tools: list[dict]) -> list[dict]:
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError('each tool must be {"type": "function", "function": {"name": ...}}')
        functions.append(function)
    return functions


def _parameters(function: dict) -> dict:
    return copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)


def forced_calls_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON schema forced output must match: for a named function its parameters schema
    (the output is the arguments object); for "required" (name None) a non-empty array of
    `{"name": <a tool's name>, "parameters": <its arguments>}`, as vLLM forces it. Each tool's
    `$defs`/`definitions` move to the root so that their "#/$defs/..." references resolve."""
    functions = _functions(tools)
    if name is not None:
        for function in functions:
            if function["name"] == name:
                return _parameters(function)
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool")
    alternatives, hoisted = [], {}
    for function in functions:
        parameters = _parameters(function)
        for key in ("$defs", "definitions"):
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                defs = hoisted.setdefault(key, {})
                if defs.setdefault(def_name, schema) != schema:
                    raise ValueError(
                        f"tools define {key}/{def_name} differently; rename one of them"
                    )
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": function["name"]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}, **hoisted}


def _whole(parse: _Parse[T], src: _Src) -> T:
    """Runs a parser over a whole text, which it must take up to trailing whitespace."""
    try:
        parse.send(None)
    except StopIteration as stop:
        src.pos = _WS.match(src.text, src.pos).end()
        if src.pos != len(src.text):
            raise ValueError("forced tool-call output has text after its JSON") from None
        return stop.value
    except _Fail:
        raise ValueError("forced tool-call output is not the JSON its schema asks for") from None
    raise AssertionError("a parser over a final text waited for more")


def forced_calls(text: str, name: str | None, parser: str = "hermes") -> list[ToolCall]:
    """The calls in output forced by `forced_calls_schema(tools, name)`: for a named function
    the text is its arguments object; for "required" an array of {"name", "parameters"}.
    Ids follow `parser`'s family (Mistral's are 9 characters). ValueError where the text is
    not such JSON (output cut short by max_tokens)."""
    short = _family(parser).short_ids
    src = _Src(text, final=True)
    if name is not None:
        return [ToolCall(_new_id(short), name, _whole(_object_text(src), src))]
    calls = _whole(_call_list(src, ("parameters",)), src)
    return [ToolCall(_new_id(short), n, arguments) for n, arguments in calls]
