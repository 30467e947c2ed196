"""The tool-call families by the name `--tool-call-parser` gives them."""

from __future__ import annotations

from service.parsers.tool_calls.deepseek import DEEPSEEK
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.hermes import HERMES
from service.parsers.tool_calls.llama3_json import LLAMA3_JSON
from service.parsers.tool_calls.mistral import MISTRAL

FAMILIES: dict[str, Family] = {
    "hermes": HERMES,
    "mistral": MISTRAL,
    "deepseek": DEEPSEEK,
    "llama3_json": LLAMA3_JSON,
}
PARSERS: tuple[str, ...] = tuple(FAMILIES)


def family_named(parser: str) -> Family:
    try:
        return FAMILIES[parser]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {parser!r}; choose from {', '.join(PARSERS)}"
        ) from None
