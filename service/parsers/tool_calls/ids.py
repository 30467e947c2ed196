"""Tool-call ids: "call_" + 24 random letters and digits (as OpenAI's), or 9 letters and
digits for Mistral, whose chat templates and mistral-common require that form."""

from __future__ import annotations

import secrets
import string

from service.parsers.tool_calls.registry import family_named

_ALNUM = string.ascii_letters + string.digits


def new_id(short: bool) -> str:
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_call_id(parser: str) -> str:
    """A fresh tool-call id in `parser`'s family's form (Mistral's are 9 characters)."""
    return new_id(family_named(parser).short_ids)
