"""MiniMax-M2: the model writes no `<think>` (its template opens the block), only `</think>`;
the text before it is reasoning (think.py, implicit), as vLLM's MiniMaxM2ReasoningParser."""

from __future__ import annotations

from service.parsers.reasoning.think import THINK_CLOSE, ThinkReasoning

END = THINK_CLOSE


def minimax_m2() -> ThinkReasoning:
    return ThinkReasoning(implicit=True)
