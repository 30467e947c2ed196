"""vLLM's /tokenize and /detokenize utilities."""

from __future__ import annotations

import asyncio

from litestar import Controller, Request, post

from service.auth import reject_while_draining, require_api_key
from service.controllers.common import chat_prompt_ids, check_model, serving_state, text_prompt_ids
from service.errors import BadRequest
from service.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


class TokenizeController(Controller):
    path = "/"
    tags = ("Tokenizer",)
    guards = (require_api_key, reject_while_draining)

    @post("/tokenize", operation_id="tokenize", status_code=200)
    async def tokenize(self, request: Request, data: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered through the chat template."""
        state = serving_state(request)
        check_model(state, data.model)
        if (data.prompt is None) == (data.messages is None):
            raise BadRequest("give exactly one of prompt or messages", param="prompt")
        if data.messages is not None:
            ids = await chat_prompt_ids(state, data.messages, data.add_generation_prompt)
        else:
            ids = await text_prompt_ids(state, data.prompt, data.add_special_tokens)
        return TokenizeResponse(
            count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids
        )

    @post("/detokenize", operation_id="detokenize", status_code=200)
    async def detokenize(self, request: Request, data: DetokenizeRequest) -> DetokenizeResponse:
        """Text of a list of token ids."""
        state = serving_state(request)
        check_model(state, data.model)
        tokenizer = state.engine.tokenizer
        vocab = max(len(tokenizer), state.engine.args.vocab_size)
        if any(t < 0 or t >= vocab for t in data.tokens):
            raise BadRequest(f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, data.tokens)
        return DetokenizeResponse(prompt=text)
