"""Prompt -> token ids, the same way for the REST and gRPC APIs, off the event loop.

Length and vocabulary checks stay with the engine (ServingState.generate)."""

from __future__ import annotations

import asyncio

import jinja2

from service.errors import BadRequest


async def chat_prompt_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True
) -> list[int]:
    """Renders the model's chat template and tokenizes the result."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template; send a plain prompt instead",
            param="messages",
            code="no_chat_template",
        )
    return await asyncio.to_thread(_render_chat, tokenizer, messages, add_generation_prompt)


async def text_prompt_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:  # raise_exception() too
        raise BadRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    # The template already wrote any special tokens it wants (vLLM does the same).
    return tokenizer.encode(text, add_special_tokens=False)
