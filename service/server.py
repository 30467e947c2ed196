"""The server of `moeserve serve`: the engine, the REST server (uvicorn + Litestar) and the
gRPC server in one process and one event loop, with a graceful drain on SIGTERM/SIGINT
(service/process.py hands it the signals; state_builder.py builds what it serves).

Shutdown order: stop admitting (/ready 503, new requests 503 on both APIs), let in-flight
requests finish within `drain_timeout`, stop uvicorn and gRPC, stop the engine, exit 0.
SIGHUP reads --api-keys-file again (service/api_keys.py); requests in flight are untouched.

When the engine core process dies (killed, OOM, crashed) the server cannot serve again: its
streams end with an engine_dead error event, /health, /ready and new requests answer 503
for ENGINE_DEAD_EXIT_DELAY_S, then the process exits with EXIT_ENGINE_DEAD so that its
supervisor (docker compose `restart: unless-stopped`, Kubernetes `restartPolicy: Always`)
starts a fresh one (vLLM's API server exits the same way).
"""

from __future__ import annotations

import asyncio
import socket

from inference import InvalidParameterError
from service.api_keys import KeyRing, KeysFileError
from service.app import create_app
from service.grpc_server import GrpcServer
from service.rest_listener import SignalFreeUvicorn, bind_rest_socket, rest_server
from service.settings import Settings, cost_per_hour
from service.startup import ServingSwitch, StartupProgress, publish
from service.state import ServingState
from service.state_builder import build_inspector, load_serving_state
from service.tls import TlsFiles
from telemetry import instance
from telemetry.logging import get_logger

log = get_logger("service.server")

EXIT_ENGINE_DEAD = 3
ENGINE_DEAD_EXIT_DELAY_S = 2.0  # probes and streams see the 503s / error events first
ENGINE_WATCH_INTERVAL_S = 0.2


class MoeServer:
    """Owns the engine, the uvicorn server and the gRPC server for one `serve`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state: ServingState | None = None
        self.rest_port: int | None = None
        self.grpc_port: int | None = None
        self.instance_id: str | None = None  # service.instance.id, once the port is bound
        self._uvicorn: SignalFreeUvicorn | None = None
        self._grpc: GrpcServer | None = None
        self._sock: socket.socket | None = None
        self._rest: asyncio.Future | None = None  # uvicorn's serve(), from the start
        self._shutdown: asyncio.Task | None = None
        self._engine_died = False
        self.tls: TlsFiles | None = None
        self.startup: StartupProgress | None = None

    async def start(self) -> None:
        s = self.settings
        self.startup = progress = StartupProgress()
        inspector = build_inspector(s)  # first: its settings can fail the start at once
        # the files first: a bad one stops the server before the model loads
        self.tls = TlsFiles.from_settings(s)
        keys = KeyRing(s.api_key, s.api_keys_file)
        if s.cost_per_hour is not None:  # Settings built in code skip the CLI's check
            try:
                cost_per_hour(s.cost_per_hour)
            except ValueError as exc:
                raise InvalidParameterError("cost_per_hour", str(exc)) from None
        # listening from the start: /ready says which phase the start is in (503)
        self._sock = bind_rest_socket(s.host, s.port)
        self.rest_port = self._sock.getsockname()[1]
        # which replica this is, for spans, log lines and the inspector: from here on
        self.instance_id = instance.assign(self.rest_port)
        switch = ServingSwitch(progress)
        self._uvicorn = rest_server(switch, self.tls)
        self._rest = asyncio.ensure_future(self._uvicorn.serve(sockets=[self._sock]))
        while not self._uvicorn.started and not self._rest.done():
            await asyncio.sleep(0.005)
        try:
            if not self._uvicorn.started:
                raise RuntimeError("the REST listener did not start")
            self.state = await load_serving_state(s, inspector, keys, progress.on_engine_phase)
            progress.mark("ready")
            self.state.startup = progress
            self.state.instance_id = self.instance_id
            await switch.serve(create_app(self.state))
            if s.grpc_port >= 0:
                credentials = self.tls.grpc_credentials() if self.tls else None
                self._grpc = await GrpcServer.start(self.state, s.host, s.grpc_port, credentials)
                self.grpc_port = self._grpc.port
        except BaseException:
            self._uvicorn.should_exit = True  # the port closes with a failed start
            await asyncio.gather(self._rest, return_exceptions=True)
            raise

    async def run(self) -> int:
        """Serves until shut down (see `request_shutdown`); returns the exit code."""
        task = self._rest  # start() returned: uvicorn is serving
        self.startup.finish()
        publish(self.startup, self.state.observability, self.settings.startup_budget)
        log.info(
            "server started",
            rest_port=self.rest_port,
            grpc_port=self.grpc_port,
            host=self.settings.host,
            tls=self.tls.mode if self.tls else "off",
            api_keys=len(self.state.keys.names),
            model=self.state.model_name,
            max_model_len=self.state.engine.max_model_len,
        )
        watch = asyncio.ensure_future(self._watch_engine())
        try:
            await task
        finally:
            watch.cancel()
            if self._shutdown is not None and not self._shutdown.done():
                await asyncio.gather(self._shutdown, return_exceptions=True)
            await self._stop_grpc()  # no-op if the drain stopped it already
            await self.state.engine.shutdown()
            if self.state.inspector is not None:
                self.state.inspector.detach()
            log.info("server stopped")
        if self._engine_died:
            return EXIT_ENGINE_DEAD
        return 0

    async def _watch_engine(self) -> None:
        """Exits the server (EXIT_ENGINE_DEAD) once the engine core has died outside a
        shutdown, after ENGINE_DEAD_EXIT_DELAY_S of 503s."""
        engine = self.state.engine
        while engine.is_alive and self._shutdown is None:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        if self._shutdown is not None:
            return  # a drain stops the engine on purpose
        self._engine_died = True
        log.error(
            "engine core died; exiting so that the supervisor restarts the server",
            exit_code=EXIT_ENGINE_DEAD,
            exit_in_s=ENGINE_DEAD_EXIT_DELAY_S,
        )
        await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
        if self._grpc is not None:
            await self._grpc.mark_not_serving()
        self._uvicorn.should_exit = True
        await self._stop_grpc()

    def reload_keys(self) -> None:
        """SIGHUP: --api-keys-file read again. A file that does not load leaves the keys in
        force as they were; requests in flight go on either way (a revoked key's included)."""
        keys = self.state.keys
        if keys.path is None:
            log.warning("SIGHUP ignored: no --api-keys-file to reload")
            return
        try:
            keys.reload()
        except KeysFileError as exc:
            log.error("API keys not reloaded; the previous keys stay in force", error=str(exc))
            return
        self.state.observability.add_keys(keys.labels())
        log.info("API keys reloaded", keys=keys.names)

    def request_shutdown(self) -> None:
        """Starts the graceful drain; a second call forces an immediate exit."""
        if self._shutdown is not None:
            log.warning("second shutdown request: exiting without waiting")
            self._shutdown.cancel()
            self._uvicorn.force_exit = self._uvicorn.should_exit = True
            return
        self._shutdown = asyncio.ensure_future(self._drain_and_stop())

    async def _drain_and_stop(self) -> None:
        timeout = self.settings.drain_timeout
        log.info("draining", in_flight=self.state.in_flight, drain_timeout_s=timeout)
        self.state.draining = True
        if self._grpc is not None:
            await self._grpc.mark_not_serving()
        if not await self.state.drain(timeout):
            log.warning(
                "drain timed out; stopping with requests in flight", in_flight=self.state.in_flight
            )
        self._uvicorn.should_exit = True
        await self._stop_grpc()

    async def _stop_grpc(self) -> None:
        if self._grpc is not None:
            server, self._grpc = self._grpc, None
            await server.stop(1.0)
