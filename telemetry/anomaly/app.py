"""The anomaly-detection webhook: a small Litestar app.

POST /alerts          Alertmanager webhook payload (version 4); 400 when malformed,
                      413 over the body limit. Firing alerts are queued for analysis
                      (bounded queue, de-duplicated by fingerprint); the response
                      never waits for Prometheus.
GET  /incidents       recent incidents, newest first (?limit=, ?alertname=)
GET  /incidents/{id}  one incident
GET  /metrics         the webhook's own metrics (private CollectorRegistry)
GET  /health          liveness
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Annotated, Any

import httpx
import msgspec
import structlog
from litestar import Litestar, Request, get, post
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import Parameter
from litestar.response import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .analyzer import Analyzer, alert_fingerprint, replica_of
from .config import WebhookSettings
from .forward import Forwarder
from .incidents import Deduplicator, IncidentStore
from .metrics import WebhookMetrics
from .prometheus_api import PrometheusAPI
from .schemas import AlertmanagerAlert, AlertmanagerPayload, Incident

log = structlog.get_logger("telemetry.anomaly")


class Webhook:
    """Everything the handlers share; created by ``create_app`` and held on app.state."""

    def __init__(
        self,
        settings: WebhookSettings,
        *,
        prometheus_transport: httpx.AsyncBaseTransport | None = None,
        forward_transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.metrics = WebhookMetrics()
        self.store = IncidentStore(settings.max_incidents)
        self.dedupe = Deduplicator(settings.dedupe_s)
        self.clock = clock
        self._prometheus_transport = prometheus_transport
        self._forward_transport = forward_transport
        self.queue: asyncio.Queue[tuple[AlertmanagerAlert, float]] | None = None
        self.analyzer: Analyzer | None = None
        self.forwarder: Forwarder | None = None
        self._workers: list[asyncio.Task[None]] = []

    # -- lifecycle (runs inside the server's event loop)
    async def start(self) -> None:
        s = self.settings
        self.queue = asyncio.Queue(maxsize=s.queue_size)
        prometheus = PrometheusAPI(
            s.prometheus_url, timeout_s=s.query_timeout_s, transport=self._prometheus_transport
        )
        self.analyzer = Analyzer(s, prometheus, clock=self.clock)
        if s.forward_url:
            self.forwarder = Forwarder(
                s.forward_url,
                self.metrics,
                timeout_s=s.forward_timeout_s,
                retries=s.forward_retries,
                backoff_s=s.forward_backoff_s,
                queue_size=s.forward_queue_size,
                transport=self._forward_transport,
            )
            self.forwarder.start()
        self._workers = [
            asyncio.create_task(self._work(), name=f"anomaly-worker-{i}") for i in range(s.workers)
        ]

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []
        if self.forwarder is not None:
            await self.forwarder.stop()
        if self.analyzer is not None:
            await self.analyzer.prometheus.aclose()

    # -- receiving
    def accept(self, payload: AlertmanagerPayload) -> dict[str, int]:
        assert self.queue is not None, "webhook not started"
        counts = {"queued": 0, "duplicate": 0, "dropped": 0, "over_cap": 0, "resolved": 0}
        received_at = self.clock()
        analysed = 0
        for alert in payload.alerts:
            if alert.status == "resolved":
                ends = alert.endsAt.timestamp() if alert.endsAt else received_at
                self.store.mark_resolved(alert_fingerprint(alert), ends)
                handling = "resolved"
            elif analysed >= self.settings.max_alerts_per_payload:
                handling = "over_cap"
            elif self.dedupe.seen(key := f"{alert_fingerprint(alert)}@{alert.startsAt}"):
                handling = "duplicate"
            else:
                analysed += 1
                try:
                    self.queue.put_nowait((alert, received_at))
                    handling = "queued"
                except asyncio.QueueFull:
                    self.dedupe.forget(key)  # not analysed: a re-send may be
                    handling = "dropped"
            counts[handling] += 1
            self.metrics.alerts.labels(status=alert.status, handling=handling).inc()
        self.metrics.queue_depth.set(self.queue.qsize())
        if counts["dropped"] or counts["over_cap"]:
            log.warning(
                "alerts not analysed",
                dropped=counts["dropped"],
                over_cap=counts["over_cap"],
                group_key=payload.groupKey,
            )
        return counts

    # -- analysing
    async def _work(self) -> None:
        assert self.queue is not None and self.analyzer is not None
        while True:
            alert, received_at = await self.queue.get()
            try:
                t0 = time.perf_counter()
                try:
                    incident = await self.analyzer.analyze(alert, received_at)
                except Exception as exc:  # a bug must neither kill the worker nor lose the alert
                    log.exception("alert analysis failed", alertname=alert.labels.get("alertname"))
                    incident = _bare_incident(alert, received_at, f"analysis failed: {exc!r}")
                self.metrics.analysis_seconds.observe(time.perf_counter() - t0)
                self.record(incident)
            finally:
                self.queue.task_done()
                self.metrics.queue_depth.set(self.queue.qsize())

    def record(self, incident: Incident) -> None:
        self.store.add(incident)
        self.metrics.incidents.labels(prometheus=incident.prometheus).inc()
        self.metrics.stored.set(len(self.store))
        log.warning(
            "incident",
            incident_id=incident.id,
            alertname=incident.alertname,
            severity=incident.severity,
            alert_status=incident.status,
            fingerprint=incident.fingerprint,
            model=incident.labels.get("model"),
            instance=incident.labels.get("instance"),
            replica=incident.replica,
            top_metrics=incident.top_metrics,
            causes=[c.cause for c in incident.causes],
            scores={m.name: m.score for m in incident.metrics[:5]},
            multivariate_score=incident.multivariate_score,
            trace_ids=[e.trace_id for e in incident.exemplars],
            prometheus=incident.prometheus,
            reason=incident.reason,
            analysis_ms=round(incident.analysis_seconds * 1000, 1),
        )
        if self.forwarder is not None:
            self.forwarder.submit(incident)

    async def drain(self) -> None:
        """Wait until every queued alert has become an incident (tests, shutdown)."""
        if self.queue is not None:
            await self.queue.join()


def _bare_incident(alert: AlertmanagerAlert, received_at: float, reason: str) -> Incident:
    return Incident(
        id=uuid.uuid4().hex,
        received_at=received_at,
        alertname=alert.labels.get("alertname", ""),
        severity=alert.labels.get("severity", ""),
        status=alert.status,
        fingerprint=alert_fingerprint(alert),
        labels=dict(alert.labels),
        annotations=dict(alert.annotations),
        starts_at=None,
        replica=replica_of(alert.labels),
        prometheus="error",
        reason=reason,
    )


def _webhook(state: State) -> Webhook:
    return state["webhook"]


def _bad_request(reason: str) -> Response[dict[str, str]]:
    return Response({"error": "invalid Alertmanager payload", "reason": reason}, status_code=400)


@post("/alerts", status_code=200, operation_id="receiveAlerts")
async def receive_alerts(request: Request[Any, Any, State], state: State) -> Response[Any]:
    """Receive an Alertmanager webhook notification (payload version 4)."""
    webhook = _webhook(state)
    try:
        body = await request.body()
    except RequestEntityTooLarge:
        webhook.metrics.payloads.labels(result="too_large").inc()
        raise
    try:
        payload = msgspec.json.decode(body, type=AlertmanagerPayload)
    except msgspec.ValidationError as exc:
        webhook.metrics.payloads.labels(result="invalid").inc()
        return _bad_request(str(exc))
    except msgspec.DecodeError as exc:
        webhook.metrics.payloads.labels(result="invalid").inc()
        return _bad_request(f"body is not JSON: {exc}")
    webhook.metrics.payloads.labels(result="accepted").inc()
    return Response({"status": "accepted", **webhook.accept(payload)})


@get("/incidents", operation_id="listIncidents")
async def list_incidents(
    state: State,
    limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
    alertname: str | None = None,
) -> dict[str, Any]:
    """Recent incidents, newest first."""
    items = _webhook(state).store.recent()
    if alertname:
        items = [i for i in items if i.alertname == alertname]
    return {"incidents": msgspec.to_builtins(items[:limit])}


@get("/incidents/{incident_id:str}", operation_id="getIncident")
async def get_incident(state: State, incident_id: str) -> dict[str, Any]:
    """One incident by id."""
    incident = _webhook(state).store.get(incident_id)
    if incident is None:
        raise NotFoundException(f"no incident {incident_id}")
    return msgspec.to_builtins(incident)


@get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics(state: State) -> Response[bytes]:
    """The webhook's own Prometheus metrics."""
    registry = _webhook(state).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@get("/health", operation_id="health")
async def health(state: State) -> dict[str, Any]:
    """Liveness, queue depth and stored incident count."""
    webhook = _webhook(state)
    depth = webhook.queue.qsize() if webhook.queue is not None else 0
    return {"status": "ok", "queue_depth": depth, "incidents": len(webhook.store)}


def create_app(
    settings: WebhookSettings | None = None,
    *,
    prometheus_transport: httpx.AsyncBaseTransport | None = None,
    forward_transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.time,
    **overrides: Any,
) -> Litestar:
    """Build the webhook app. ``overrides`` are WebhookSettings fields
    (e.g. ``prometheus_url=...``); the transports are for tests."""
    settings = replace(settings or WebhookSettings(), **overrides)
    webhook = Webhook(
        settings,
        prometheus_transport=prometheus_transport,
        forward_transport=forward_transport,
        clock=clock,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await webhook.start()
        try:
            yield
        finally:
            await webhook.stop()

    return Litestar(
        route_handlers=[receive_alerts, list_incidents, get_incident, metrics, health],
        state=State({"webhook": webhook}),
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
    )
