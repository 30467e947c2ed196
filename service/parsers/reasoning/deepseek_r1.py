"""DeepSeek-R1 (and V3.1 in thinking mode): its chat template opens `<think>` in the prompt, so
the output is reasoning until `</think>` (think.py, implicit), as vLLM's
DeepSeekR1ReasoningParser."""

from __future__ import annotations

from service.parsers.reasoning.think import THINK_CLOSE, ThinkReasoning

END = THINK_CLOSE


def deepseek_r1() -> ThinkReasoning:
    return ThinkReasoning(implicit=True)
