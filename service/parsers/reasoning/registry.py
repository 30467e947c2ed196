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

HARMONY_CHANNEL = "<|channel|>"
# By architecture: the parser, and what the chat template writes where the model reasons (a
# demo checkpoint's ChatML template has neither, so its random text stays content)
_ARCH_PARSERS = {
    "DeepseekV3ForCausalLM": ("deepseek_r1", THINK_OPEN),  # R1, V3.1 (V3's template: none)
    "GptOssForCausalLM": ("gpt_oss", HARMONY_CHANNEL),
    "Glm4MoeForCausalLM": ("glm45", THINK_OPEN),
    "MiniMaxM2ForCausalLM": ("minimax_m2", THINK_OPEN),
}


def reasoning_parser_named(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}"
        ) from None


def reasoning_parser_for(architecture: str, chat_template: str | None) -> str | None:
    """The reasoning parser `auto` gives a checkpoint: its architecture's, where its chat
    template shows the model reasoning (`<think>`; harmony's channels for gpt-oss, whose
    prompts harmony renders even without a template); None where the model does not reason."""
    parser, sign = _ARCH_PARSERS.get(architecture, (None, None))
    if parser == "gpt_oss" and chat_template is None:
        return parser
    return parser if sign is not None and sign in (chat_template or "") else None
