"""vLLM's /tokenize and /detokenize utilities."""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Controller, Request, post

from service import validation
from service.auth import reject_while_draining, require_api_key
from service.controllers.common import serving_state
from service.errors import BadRequest
from service.openapi_errors import errors
from service.responses import DetokenizeResponse, TokenizeResponse
from service.schemas import DetokenizeRequest, TokenizeRequest, chat_message_dicts


class TokenizeController(Controller):
    path = "/"
    tags = ("Tokenizer",)
    guards = (require_api_key, reject_while_draining)

    @post(
        "/tokenize",
        operation_id="tokenize",
        status_code=200,
        responses=errors(400, 401, 404, 413, 503),
    )
    async def tokenize(self, request: Request, data: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered through the chat template."""
        state = serving_state(request)
        validation.check_model(state.model_name, data.model)
        validation.one_of(
            ("prompt", data.prompt is not None), ("messages", data.messages is not None)
        )
        tokenizer = state.engine.tokenizer
        if data.messages is not None:
            tools = msgspec.to_builtins(data.tools) if data.tools else None
            ids = await validation.chat_ids(
                tokenizer,
                chat_message_dicts(data.messages),
                None,
                data.add_generation_prompt,
                tools,
                data.continue_final_message,
            )
        else:
            if data.continue_final_message:
                raise BadRequest(
                    "continue_final_message applies to messages, not to a prompt",
                    param="continue_final_message",
                )
            ids = await validation.text_ids(tokenizer, data.prompt, None, data.add_special_tokens)
        return TokenizeResponse(
            count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids
        )

    @post(
        "/detokenize",
        operation_id="detokenize",
        status_code=200,
        responses=errors(400, 401, 404, 413, 503),
    )
    async def detokenize(self, request: Request, data: DetokenizeRequest) -> DetokenizeResponse:
        """Text of a list of token ids."""
        state = serving_state(request)
        validation.check_model(state.model_name, data.model)
        tokenizer = state.engine.tokenizer
        vocab = state.engine.args.vocab_size  # as for prompts of token ids
        if any(t >= vocab for t in data.tokens):
            raise BadRequest(f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, data.tokens)
        return DetokenizeResponse(prompt=text)
