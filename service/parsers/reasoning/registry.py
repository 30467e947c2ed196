"""The reasoning parsers by the name `--reasoning-parser` gives them, and the one `auto` picks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.parsers.reasoning import deepseek_r1, glm45, gpt_oss, minimax_m2
from service.parsers.reasoning.stream import ReasoningStream
from service.parsers.reasoning.think import THINK_OPEN


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    stream: Callable[[], ReasoningStream]  # a new stream for one choice
    end: str  # the text after which the answer starts (where a grammar starts)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser(deepseek_r1.deepseek_r1, deepseek_r1.END),
    "gpt_oss": ReasoningParser(gpt_oss.gpt_oss, gpt_oss.END),
    "glm45": ReasoningParser(glm45.glm45, glm45.END),
    "minimax_m2": ReasoningParser(minimax_m2.minimax_m2, minimax_m2.END),
}
REASONING_PARSERS: tuple[str, ...] = tuple(PARSERS)

_ARCH_PARSERS = {
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm45",
    "MiniMaxM2ForCausalLM": "minimax_m2",
}


def reasoning_parser_named(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}"
        ) from None


def reasoning_parser_for(architecture: str, chat_template: str | None) -> str | None:
    """The reasoning parser `auto` gives a checkpoint: by architecture, and for
    DeepseekV3ForCausalLM (V3, R1, V3.1, Kimi-K2, Moonlight) deepseek_r1 only where the chat
    template thinks (writes `<think>`: R1, V3.1); None where the model does not reason."""
    if architecture == "DeepseekV3ForCausalLM":
        return "deepseek_r1" if THINK_OPEN in (chat_template or "") else None
    return _ARCH_PARSERS.get(architecture)
