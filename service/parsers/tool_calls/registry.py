"""The tool-call families by the name `--tool-call-parser` gives them."""

from __future__ import annotations

from service.parsers.tool_calls.deepseek import DEEPSEEK
from service.parsers.tool_calls.deepseek_v31 import DEEPSEEK_V31
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.glm45 import GLM45
from service.parsers.tool_calls.hermes import HERMES
from service.parsers.tool_calls.kimi_k2 import KIMI_K2
from service.parsers.tool_calls.llama3_json import LLAMA3_JSON
from service.parsers.tool_calls.minimax_m2 import MINIMAX_M2
from service.parsers.tool_calls.mistral import MISTRAL
from service.parsers.tool_calls.openai import OPENAI

FAMILIES: dict[str, Family] = {
    "hermes": HERMES,
    "mistral": MISTRAL,
    "deepseek": DEEPSEEK,
    "llama3_json": LLAMA3_JSON,
    "deepseek_v31": DEEPSEEK_V31,
    "kimi_k2": KIMI_K2,
    "glm45": GLM45,
    "minimax_m2": MINIMAX_M2,
    "openai": OPENAI,  # gpt-oss: its calls are harmony messages (openai.py)
}
PARSERS: tuple[str, ...] = tuple(FAMILIES)


def family_named(parser: str) -> Family:
    try:
        return FAMILIES[parser]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {parser!r}; choose from {', '.join(PARSERS)}"
        ) from None
