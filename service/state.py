"""What the REST and gRPC servers share: the engine, the settings, readiness and draining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from inference import AsyncLLMEngine, RequestOutput, SamplingParams
from service.errors import ENGINE_ERRORS, Unavailable, from_engine_error
from service.observability import Observability, genai_operation, status_of
from service.settings import Settings


@dataclass
class ServingState:
    engine: AsyncLLMEngine
    settings: Settings
    model_name: str
    draining: bool = False
    in_flight: int = 0
    observability: Observability = field(default_factory=Observability.disabled)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ready(self) -> bool:
        return self.engine.is_alive and not self.draining

    async def generate(
        self,
        api: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        log_context: dict | None = None,
        *,
        operation: str | None = None,
        stream: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The one path from either API into the engine: admission while draining, engine
        errors mapped to service errors, in-flight accounting for a graceful drain, and the
        request's telemetry (service/observability.py). `operation` is the GenAI operation
        name (default: from `api`), `stream` whether the caller streams."""
        rt, owned = self.observability.request(api, request_id)
        finished = False
        try:
            if self.draining:
                raise Unavailable("server is shutting down", code="draining")
            log_context = rt.admit(
                request_id, prompt, params, operation or genai_operation(api), stream, log_context
            )
            self.in_flight += 1
            self._idle.clear()
            agen = self.engine.stream(
                prompt, params, request_id=request_id, log_context=log_context
            )
            try:
                async for out in agen:
                    rt.observe(out)
                    finished = out.finished
                    yield out
            except ENGINE_ERRORS as exc:
                raise from_engine_error(exc) from exc
            finally:
                await agen.aclose()  # a consumer that left early aborts the request now, not at GC
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()
        except BaseException as exc:
            if not (finished and isinstance(exc, (GeneratorExit, asyncio.CancelledError))):
                rt.fail(exc, status_of(exc))
            raise
        finally:
            if not finished:
                rt.fail(None, "client_error")  # left before the end (no-op after a failure)
            if owned:
                rt.finish("ok")

    async def drain(self, timeout: float) -> bool:
        """Stops admitting requests and waits for the in-flight ones; False on timeout."""
        self.draining = True
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
