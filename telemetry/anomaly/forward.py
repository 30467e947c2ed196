"""Forwards enriched incidents to another webhook, off the receiver's path.

``submit`` never blocks: incidents go to a bounded queue (dropped and counted when it
is full); one background task POSTs them with a timeout and bounded retries.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
import structlog

from .metrics import WebhookMetrics
from .schemas import Incident

log = structlog.get_logger("telemetry.anomaly.forward")


class Forwarder:
    def __init__(
        self,
        url: str,
        metrics: WebhookMetrics,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        queue_size: int = 100,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.metrics = metrics
        self.retries = retries
        self.backoff_s = backoff_s
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=queue_size)
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="anomaly-forwarder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()

    def submit(self, incident: Incident) -> bool:
        try:
            self._queue.put_nowait(msgspec.json.encode(incident))
        except asyncio.QueueFull:
            self.metrics.forwarded.labels(result="dropped").inc()
            return False
        return True

    async def join(self) -> None:
        """Wait until every submitted incident has been delivered or given up on."""
        await self._queue.join()

    async def _run(self) -> None:
        while True:
            body = await self._queue.get()
            try:
                ok = await self._deliver(body)
                self.metrics.forwarded.labels(result="ok" if ok else "failed").inc()
            finally:
                self._queue.task_done()

    async def _deliver(self, body: bytes) -> bool:
        headers = {"content-type": "application/json"}
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._client.post(self.url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                error = f"{exc.__class__.__name__}: {exc}"
            else:
                if resp.status_code < 300:
                    return True
                error = f"HTTP {resp.status_code}"
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    break  # the receiver rejected it: retrying will not help
        log.warning("incident forward failed", url=self.url, error=error, attempts=attempt + 1)
        return False
