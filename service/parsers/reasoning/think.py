"""Reasoning between `<think>` and `</think>`: the parsers of DeepSeek-R1, GLM-4.5 and MiniMax-M2.

`implicit` (DeepSeek-R1, MiniMax-M2): the chat template opens `<think>` in the prompt, so the
output starts inside the reasoning; a `<think>` the model writes anyway at the very start (after
whitespace) is dropped, and everything up to the first `</think>` is reasoning (all of it if
the output stops before one), as vLLM's DeepSeekR1ReasoningParser and MiniMaxM2ReasoningParser.

explicit (GLM-4.5): the model opens the block itself; output without `<think>` is all content
(the template's enable_thinking=False), as vLLM's Glm4MoeModelReasoningParser. Text before the
`<think>` stays content and one block is read; after `</think>` everything is content.

Where vLLM's streamed and non-streamed parses differ, the streamed one is followed, since a
stream cannot take back what it sent: a GLM block cut short (no `</think>`) is reasoning, and
text before the opening marker is kept (vLLM's whole-text parse drops it).
"""

from __future__ import annotations

from service.parsers.reasoning.stream import ReasoningDelta

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkReasoning:
    def __init__(self, implicit: bool) -> None:
        # "lead": an implicit block's start (a written <think> to drop); "before": waiting for
        # an explicit <think>; "reasoning"; "content"
        self._state = "lead" if implicit else "before"
        self._pending = ""
        self._done = False

    def feed(self, text: str) -> ReasoningDelta:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        return self._run()

    def finish(self) -> ReasoningDelta:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        return self._run()

    def _run(self) -> ReasoningDelta:
        reasoning, content = [], []
        while self._pending:
            text, state = self._pending, self._state
            if state == "content":
                content.append(text)
                self._pending = ""
            elif state == "lead":
                body = text.lstrip()
                if body.startswith(THINK_OPEN):
                    self._pending = body[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(body) and not self._done:
                    break  # whitespace or a start of <think>: wait
                self._state = "reasoning"
            else:
                marker = THINK_OPEN if state == "before" else THINK_CLOSE
                out = content if state == "before" else reasoning
                at = text.find(marker)
                if at < 0:
                    keep = 0 if self._done else _held(text, marker)
                    out.append(text[: len(text) - keep])
                    self._pending = text[len(text) - keep :]
                    break
                out.append(text[:at])
                self._pending = text[at + len(marker) :]
                self._state = "reasoning" if state == "before" else "content"
        return ReasoningDelta("".join(reasoning), "".join(content))
