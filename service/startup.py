"""A start's phases as the service sees them (SPEC section 13): where the time went from
`moeserve serve` to serving, and what /ready says while the model loads.

The engine marks its phases (inference/startup.py) and sends each mark as it happens; this
side adds its own ends: load_weights starts with the server's start (resolving the model,
spawning the engine process, importing torch: all before a weight can load), and "ready"
covers building the API around the loaded engine and starting its listeners. A line is logged
as each phase ends; once serving, the phases become moeserve_startup_phase_seconds and a
"startup" trace (telemetry/startup.py).

While the engine loads, the REST listener is already up: it answers /ready and /health with
503 and the phase so far, and every other path with 503 (code "starting").
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from litestar import Litestar

from inference.startup import PhaseMark, phase_order, phase_seconds
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
    """What the REST socket answers while the engine loads: 503 everywhere, saying which
    phase the start is in."""

    def __init__(self, progress: StartupProgress) -> None:
        self.progress = progress

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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


class ServingSwitch:
    """The ASGI app on the REST socket for the server's whole life: StartingApp's 503s while
    the engine loads, then the Litestar app once `serve` hands it over. One uvicorn serves
    both, so the socket never changes hands: handing it from one listener to another reset
    the connections accepted in between (asyncio drops one accepted just before its server
    closes)."""

    def __init__(self, progress: StartupProgress) -> None:
        self._starting = StartingApp(progress)
        self._app: Litestar | None = None
        self._app_lifespan: asyncio.Task | None = None
        self._app_stop = asyncio.Event()

    async def serve(self, app: Litestar) -> None:
        """Runs `app`'s start-up (its plugins' lifespans, on_startup hooks), then hands it
        every request; raises what its start-up raised."""
        started = asyncio.get_running_loop().create_future()
        self._app_lifespan = asyncio.ensure_future(self._run_app_lifespan(app, started))
        await started
        self._app = app

    async def _run_app_lifespan(self, app: Litestar, started: asyncio.Future) -> None:
        # One task from start to end: the app's lifespan (anyio task groups) must end in the
        # task it began in.
        try:
            async with app.lifespan():
                started.set_result(None)
                await self._app_stop.wait()
        except BaseException as exc:
            if started.done():
                raise
            started.set_exception(exc)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await (self._app or self._starting)(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        """uvicorn's lifespan: the start completes at once (the app's own runs in `serve`);
        the shutdown ends the app's."""
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        if self._app_lifespan is not None:
            self._app_stop.set()
            try:
                await self._app_lifespan
            except Exception as exc:  # noqa: BLE001 - uvicorn logs the message
                await send({"type": "lifespan.shutdown.failed", "message": repr(exc)})
                return
        await send({"type": "lifespan.shutdown.complete"})


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
