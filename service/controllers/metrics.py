"""GET /metrics: the service's Prometheus registry (SPEC section 8).

Prometheus text by default; OpenMetrics, with the trace-id exemplars of the latency
histograms, when the Accept header asks for application/openmetrics-text.
"""

from __future__ import annotations

import asyncio

from litestar import Controller, Request, Response, get

from service.controllers.common import serving_state
from service.errors import NotFound
from telemetry.metrics import render_metrics


class MetricsController(Controller):
    path = "/"
    tags = ("Probes",)

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
