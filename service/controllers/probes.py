"""Probes and scrapes, outside the API key and the drain: /health (liveness), /ready
(readiness, with the engine's load) and /metrics (SPEC section 8: Prometheus text, or
OpenMetrics with the latency histograms' trace-id exemplars when the Accept header asks for
application/openmetrics-text)."""

from __future__ import annotations

import asyncio

from litestar import Controller, Request, Response, get
from litestar.openapi import ResponseSpec

from service.controllers.common import serving_state
from service.errors import NotFound
from service.responses import HealthResponse, ReadyResponse, StartupPhaseBody
from telemetry.metrics import render_metrics


class ProbesController(Controller):
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
            startup=[StartupPhaseBody(**p) for p in state.startup.report()]
            if state.startup is not None
            else [],
        )
        return Response(body, status_code=200 if state.ready else 503)

    @get("/metrics", operation_id="metrics", include_in_schema=False)
    async def metrics(self, request: Request) -> Response[bytes]:
        """Prometheus exposition of every moeserve_* metric."""
        metrics = serving_state(request).observability.metrics
        if metrics is None:
            raise NotFound("metrics are disabled on this server", code="metrics_disabled")
        # Off the event loop: the per-expert series make a scrape of a large model take a while.
        body, content_type = await asyncio.to_thread(
            render_metrics, metrics.registry, request.headers.get("accept")
        )
        return Response(body, media_type=content_type)
