"""One generation request from either API, from admission to its one summary line.

The REST controllers and the gRPC servicer parse their wire format into a GenerationInput
(service/validation.py), run it through a `Generation` and render the updates it yields.
Everything else happens here, once for both: admission (503 / UNAVAILABLE while draining;
429 / RESOURCE_EXHAUSTED for a key over its limits, before the engine sees the request; the
engine's refusals as service errors), the request's telemetry (service/observability.py)
finished exactly once, its record in the inspector (service/inspector/), per-choice deltas
and usage, tokens charged to the caller's key as they are produced, in-flight accounting for
the drain, and aborting the request in the engine when the caller stops reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from opentelemetry.trace import Span

from inference import CompletionOutput, RequestOutput
from service.api_keys import Caller
from service.errors import (
    ENGINE_ERRORS,
    BadRequest,
    RateLimited,
    Unavailable,
    from_engine_error,
    status_of,
)
from service.observability import RequestTelemetry
from service.responses import RequestMetrics, Usage
from service.state import ServingState
from service.validation import GenerationInput
from telemetry.metrics import request_latencies
from telemetry.requests import merged_times, per_request_metrics


@dataclass(frozen=True, slots=True)
class Update:
    """One engine output as the APIs render it."""

    output: RequestOutput  # everything so far (non-streamed responses read its whole texts)
    choices: list[CompletionOutput]  # the choices with something new: delta_* fields, finish
    usage: Usage

    @property
    def finished(self) -> bool:
        return self.output.finished

    def metrics(self) -> RequestMetrics:
        """The request's timings so far (`include_metrics`), from the same timestamps and
        token count the request's histogram observations use (telemetry.requests)."""
        times = merged_times(self.output.outputs)
        completion = self.usage.completion_tokens
        if times is None:
            return RequestMetrics(**dict.fromkeys(RequestMetrics.__struct_fields__))
        return RequestMetrics(
            **per_request_metrics(request_latencies(times, completion), completion)
        )


class Generation:
    """One request's life. `api` is "rest" or "grpc"; `request_id` the caller's
    (validation.request_id) or a fresh one; `span` the server span the transport opened."""

    def __init__(
        self,
        state: ServingState,
        api: str,
        request_id: str,
        span: Span,
        response_id: str | None = None,
    ) -> None:
        self.state, self.request_id = state, request_id
        # what the API answers with as the response's id, and the engine's id of the request:
        # OpenAI's `id` ("cmpl-..."); gRPC has none, so there it is the request id
        self.response_id = response_id or request_id
        self.telemetry = RequestTelemetry(state.observability, api, request_id, span)
        self.caller = state.keys.anonymous
        self.telemetry.key = self.caller.name
        inspector = state.inspector
        self.inspection = inspector.open(self.telemetry) if inspector is not None else None
        self._done_choices: set[int] = set()
        self._finished = False

    def authenticated(self, caller: Caller) -> None:
        """Who sent the request, once its key has been checked (service/auth.py)."""
        self.caller = caller
        self.telemetry.key = caller.name

    def identify(self, request_id: str, response_id: str | None = None) -> None:
        """The caller's request id, once the transport has parsed it (before admission)."""
        self.request_id = self.telemetry.request_id = request_id
        self.response_id = response_id or self.response_id

    async def updates(self, spec: GenerationInput) -> AsyncIterator[Update]:
        """The engine's outputs for `spec`. The first one comes after admission, so a refusal
        raises before the transport has sent anything. Closing the iterator early aborts the
        request in the engine and frees its blocks before the next step."""
        state, caller = self.state, self.caller
        try:
            if spec.include_metrics and not state.settings.enable_per_request_metrics:
                raise BadRequest(
                    "include_metrics needs a server started with --enable-per-request-metrics",
                    param="include_metrics",
                )
            if state.draining:
                raise Unavailable("server is shutting down", code="draining")
            try:
                caller.acquire(len(spec.prompt_ids))
            except RateLimited as exc:
                self.telemetry.rate_limited(exc.limit)
                raise
            context = self.telemetry.admit(
                self.response_id, spec, {"response_id": self.response_id}
            )
            if self.inspection is not None:
                state.inspector.admit(self.inspection, spec)
            state.enter()
            outputs = state.engine.stream(
                spec.prompt_ids,
                spec.params,
                request_id=self.response_id,
                log_context=context,
                tenant=caller.name,
            )
            try:
                async for out in outputs:
                    self.telemetry.observe(out)
                    self._finished = out.finished
                    caller.charge(sum(len(c.delta_token_ids) for c in out.outputs))
                    yield Update(out, self._new(out), _usage(out))
            except ENGINE_ERRORS as exc:
                raise from_engine_error(exc, spec.constraint_field) from exc
            finally:
                await outputs.aclose()
                state.leave()
                caller.release()
        except BaseException as exc:
            if not (self._finished and isinstance(exc, (GeneratorExit, asyncio.CancelledError))):
                self.fail(exc)
            raise
        finally:
            if not self._finished:
                self.telemetry.fail(None, "client_error")  # the caller left before the end

    async def final(self, spec: GenerationInput) -> Update:
        """The last update, for non-streamed responses."""
        update = None
        async for update in self.updates(spec):
            pass
        return update

    def _new(self, out: RequestOutput) -> list[CompletionOutput]:
        """Choices with new text or tokens or that just finished; a finished choice once."""
        new = []
        for c in out.outputs:
            if c.index in self._done_choices or not (
                c.delta_text or c.delta_token_ids or c.finish_reason
            ):
                continue
            if c.finish_reason:
                self._done_choices.add(c.index)
            new.append(c)
        return new

    def fail(self, exc: BaseException) -> None:
        """An error the request ends with (the first one counts)."""
        self.telemetry.fail(exc, status_of(exc))

    def finish(self, status: str = "ok", code: str | None = None) -> None:
        """Once, when the transport has answered; `status` its view (requests_total label) of
        the answer, unless a failure recorded before decides; `code` the HTTP status or gRPC
        code name it sent (the inspector shows it)."""
        self.telemetry.finish(status)
        if self.inspection is not None:
            self.state.inspector.close(self.inspection, code)


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
