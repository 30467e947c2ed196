"""Probes: /health (liveness) and /ready (readiness, with the engine's load)."""

from __future__ import annotations

from litestar import Controller, Request, Response, get
from litestar.openapi import ResponseSpec

from service.controllers.common import serving_state
from service.responses import HealthResponse, ReadyResponse


class HealthController(Controller):
    path = "/"
    tags = ("Probes",)

    @get(
        "/health",
        operation_id="health",
        responses={503: ResponseSpec(HealthResponse, description="The engine has died")},
    )
    async def health(self, request: Request) -> Response[HealthResponse]:
        """Liveness: 200 while the engine core runs (draining included), 503 once it has died
        (vLLM's behaviour), so that the orchestrator restarts a server that cannot serve."""
        alive = serving_state(request).engine.is_alive
        return Response(
            HealthResponse(status="ok" if alive else "engine_dead", engine_alive=alive),
            status_code=200 if alive else 503,
        )

    @get(
        "/ready",
        operation_id="ready",
        responses={503: ResponseSpec(ReadyResponse, description="Draining, or the engine died")},
    )
    async def ready(self, request: Request) -> Response[ReadyResponse]:
        """200 when the model is loaded and the engine loop alive; 503 while draining."""
        state = serving_state(request)
        engine = state.engine
        status = "ready" if state.ready else "draining" if state.draining else "engine_dead"
        body = ReadyResponse(
            status=status,
            model=state.model_name,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            in_flight=state.in_flight,
            kv_usage=engine.kv_usage,
            kv_blocks_used=engine.kv_blocks_used,
        )
        return Response(body, status_code=200 if state.ready else 503)
