"""What every controller needs: the request id, the serving state, model-name checks,
prompt preparation off the event loop, and cancellation on client disconnect."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc
from litestar import Request
from litestar.types import Scope

from inference import InvalidParameterError, SamplingParams
from service import prompts
from service.errors import BadRequest, NotFound, ServiceError
from service.sampling import build_sampling_params
from service.schemas import ChatMessage
from service.state import ServingState

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_KEY = "moeserve.request_id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class ClientClosedRequest(ServiceError):
    """The client went away before the response was ready (nginx's 499); nothing is sent."""

    status_code, grpc_code, error_type = 499, grpc.StatusCode.CANCELLED, "client_closed_request"


def request_id(scope: Scope) -> str:
    """The request's id: the caller's `x-request-id` when well-formed, else a fresh one.
    Computed once per request and cached in the ASGI scope."""
    rid = scope.get(_REQUEST_ID_KEY)
    if rid is None:
        incoming = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        text = incoming.decode("latin-1")
        rid = text if _VALID_REQUEST_ID.fullmatch(text) else uuid.uuid4().hex
        scope[_REQUEST_ID_KEY] = rid  # type: ignore[literal-required]
    return rid


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving


def check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise NotFound(
            f"The model `{model}` does not exist. Served: `{state.model_name}`.",
            param="model",
            code="model_not_found",
        )


def sampling_params(**fields: Any) -> SamplingParams:
    try:
        return build_sampling_params(**fields)
    except InvalidParameterError as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def _message_dicts(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        content = (
            m.content
            if isinstance(m.content, str) or m.content is None
            else "".join(part.text for part in m.content)
        )
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


async def chat_prompt_ids(
    state: ServingState, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    return await prompts.chat_prompt_ids(
        state.engine.tokenizer, _message_dicts(messages), add_generation_prompt
    )


async def text_prompt_ids(
    state: ServingState, prompt: str, add_special_tokens: bool = True
) -> list[int]:
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    return await prompts.text_prompt_ids(state.engine.tokenizer, prompt, add_special_tokens)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Runs `awaitable` but cancels it when the client disconnects first (vLLM's
    @with_cancellation): the generation it drives is then aborted in the engine."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientClosedRequest("client closed the connection", code="client_disconnected")
    return work.result()
