"""GLM-4.5/4.6: the model opens `<think>` itself (its template writes `<think></think>` into the
prompt when thinking is off), so output without it is all content (think.py, explicit), as
vLLM's Glm4MoeModelReasoningParser."""

from __future__ import annotations

from service.parsers.reasoning.think import THINK_CLOSE, ThinkReasoning

END = THINK_CLOSE


def glm45() -> ThinkReasoning:
    return ThinkReasoning(implicit=False)
