"""A start's phases as the service sees them (SPEC section 13): where the time went from
`moeserve serve` to serving, and what /ready says while the model loads.

The engine marks its phases (inference/startup.py) and sends each mark as it happens; this
side adds its own ends: load_weights starts with the server's start (resolving the model,
spawning the engine process, importing torch: all before a weight can load), and "ready"
covers building the API around the loaded engine and starting its listeners. A line is logged
as each phase ends; once serving, the phases become moeserve_startup_phase_seconds and a
"startup" trace (telemetry/startup.py).

While the engine loads, a stand-in listener on the REST socket answers /ready and /health
with 503 and the phase so far, and every other path with 503 (code "starting").
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import msgspec

from inference.startup import PhaseMark, phase_order, phase_seconds
from service.rest_listener import SignalFreeUvicorn, rest_server
from service.tls import TlsFiles
from telemetry.logging import get_logger
from telemetry.startup import StartupMetrics, record_startup_trace

log = get_logger("service.startup")
_encode = msgspec.json.Encoder().encode


class StartupProgress:
    """The marks of this start, from the server's own start to serving."""

    def __init__(self) -> None:
        self.began_unix_ns = time.time_ns()
        self.marks = [PhaseMark("load_weights", time.monotonic())]
        self.ended: float | None = None  # monotonic, once serving

    @property
    def phase(self) -> str:
        """The phase in progress (the last one, once serving)."""
        return self.marks[-1].phase

    def on_engine_phase(self, mark: PhaseMark) -> None:
        """The engine core reached a phase (AsyncLLMEngine's on_startup_phase: called on the
        thread that loads it). Its own load_weights continues the one begun here."""
        if mark.phase != self.phase:
            self._next(mark)

    def mark(self, phase: str) -> None:
        self._next(PhaseMark(phase, time.monotonic()))

    def _next(self, mark: PhaseMark) -> None:
        self._log_end(self.marks[-1], mark.at)
        self.marks.append(mark)

    def finish(self) -> None:
        """Serving: the last phase ends now."""
        self.ended = time.monotonic()
        self._log_end(self.marks[-1], self.ended)
        log.info("startup finished", seconds=round(self.ended - self.marks[0].at, 3))

    def _log_end(self, mark: PhaseMark, end: float) -> None:
        log.info("startup phase", phase=mark.phase, seconds=round(end - mark.at, 3))

    def seconds(self) -> dict[str, float]:
        """Seconds in each phase so far (a phase in progress: until now)."""
        return phase_seconds(self.marks, self.ended if self.ended is not None else time.monotonic())

    def report(self) -> list[dict[str, Any]]:
        """The phases reached, in the order reached, with their seconds so far."""
        seconds = self.seconds()
        return [{"phase": p, "seconds": round(seconds[p], 6)} for p in phase_order(self.marks)]


class StartingApp:
    """The ASGI app on the REST socket while the engine loads: 503 everywhere, saying which
    phase the start is in."""

    def __init__(self, progress: StartupProgress) -> None:
        self.progress = progress

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        progress = self.progress
        if scope["path"] in ("/ready", "/health"):
            body = {"status": "starting", "phase": progress.phase, "startup": progress.report()}
        else:
            message = f"the server is starting ({progress.phase}); try again once /ready is 200"
            body = {"error": {"message": message, "type": "unavailable", "code": "starting"}}
        payload = _encode(body)
        headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class StartingListener:
    """uvicorn serving StartingApp on a duplicate of the REST socket (closing it leaves the
    socket itself bound and listening for the real app: no connection is refused between)."""

    def __init__(self, sock: socket.socket, progress: StartupProgress, tls: TlsFiles | None):
        self._sock = sock.dup()
        self._server: SignalFreeUvicorn = rest_server(StartingApp(progress), tls)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close()


def publish(progress: StartupProgress, observability: Any, budget_s: float = 0.0) -> None:
    """Once serving: the phases as moeserve_startup_phase_seconds (with the budget,
    --startup-budget) and a "startup" trace (service.observability.Observability; nothing
    when telemetry is off)."""
    if not observability.enabled:
        return
    if observability.metrics is not None:
        registry, model = observability.metrics.registry, observability.model
        StartupMetrics(registry, model, budget_s).set(progress.seconds())
    end = progress.ended if progress.ended is not None else time.monotonic()
    record_startup_trace([(m.phase, m.at) for m in progress.marks], end, observability.tracer)
