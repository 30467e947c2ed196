"""`moeserve serve`: the engine, the REST server (uvicorn + Litestar) and the gRPC server in
one process and one event loop, with a graceful drain on SIGTERM/SIGINT.

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
import contextlib
import functools
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from inference import AsyncLLMEngine, InvalidParameterError, ModelLoadError
from service.api_keys import KeyRing, KeysFileError
from service.app import create_app
from service.grpc_server import GrpcServer
from service.inspector.recorder import InspectorRecorder
from service.observability import Observability
from service.settings import Settings
from service.state import ServingState
from service.tls import TlsConfigError, TlsFiles
from telemetry.logging import capture_request_lines, configure_logging, get_logger
from telemetry.metrics import ServiceMetrics
from telemetry.tracing import configure_tracing, shutdown_tracing

log = get_logger("service.server")

EXIT_ENGINE_DEAD = 3
ENGINE_DEAD_EXIT_DELAY_S = 2.0  # probes and streams see the 503s / error events first
ENGINE_WATCH_INTERVAL_S = 0.2


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `MoeServer` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """Binds the REST socket here so that port 0 resolves to a known free port. TCP_NODELAY
    on it (the accepted connections inherit it): uvicorn sets it only on sockets it binds
    itself, and without it every response written in two pieces (headers, then body; each
    SSE event) waited ~40 ms for the client's delayed ACK on a kept-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def model_path_and_name(settings: Settings) -> tuple[Path, str]:
    """`demo`, a ready model name (`smollm2`) or a checkpoint folder -> (folder, served name)."""
    from inference.checkpoints.model_zoo import READY_MODELS, resolve_model

    path = resolve_model(settings.model, demo_preset=settings.demo_preset)
    if settings.model == "demo" or settings.model in READY_MODELS:
        return path, settings.served_model_name or settings.model
    return path, settings.served_model_name or path.resolve().name


class MoeServer:
    """Owns the engine, the uvicorn server and the gRPC server for one `serve`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state: ServingState | None = None
        self.rest_port: int | None = None
        self.grpc_port: int | None = None
        self._uvicorn: _Uvicorn | None = None
        self._grpc: GrpcServer | None = None
        self._sock: socket.socket | None = None
        self._shutdown: asyncio.Task | None = None
        self._engine_died = False
        self.tls: TlsFiles | None = None

    async def start(self) -> None:
        s = self.settings
        inspector = build_inspector(s)  # first: its settings can fail the start at once
        # the files first: a bad one stops the server before the model loads
        self.tls = TlsFiles.from_settings(s)
        keys = KeyRing(s.api_key, s.api_keys_file)
        path, name = await asyncio.to_thread(model_path_and_name, s)
        # the engine core process logs like this one (same stdout, same format); for the
        # inspector it also ships the lines it logs on requests' behalf with its steps
        logging_init = capture_request_lines if inspector is not None else configure_logging
        engine = await asyncio.to_thread(
            AsyncLLMEngine.from_pretrained,
            path,
            s.device,
            s.dtype,
            functools.partial(logging_init, s.log_format),
            **s.engine_limits(),
        )
        engine.start()
        obs = build_observability(engine, s, name)
        engine.add_stats_listener(obs.on_step)
        if inspector is not None:
            inspector.attach(engine)
        self.state = ServingState(
            engine, s, name, observability=obs, inspector=inspector, keys=keys
        )
        self._sock = _bind(s.host, s.port)
        self.rest_port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.state),
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            **(self.tls.uvicorn_options() if self.tls else {}),
        )
        self._uvicorn = _Uvicorn(config)
        if s.grpc_port >= 0:
            credentials = self.tls.grpc_credentials() if self.tls else None
            self._grpc = await GrpcServer.start(self.state, s.host, s.grpc_port, credentials)
            self.grpc_port = self._grpc.port

    async def run(self) -> int:
        """Serves until shut down (see `request_shutdown`); returns the exit code."""
        server = self._uvicorn
        task = asyncio.ensure_future(server.serve(sockets=[self._sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
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
        return 0 if server.started else 1

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


def build_inspector(settings: Settings) -> InspectorRecorder | None:
    """The request inspector's recorder (service/inspector/), or None with --no-inspector."""
    if settings.no_inspector:
        return None
    return InspectorRecorder(
        settings.inspector_requests,
        log_prompts=settings.log_prompts,
        trace_url_template=settings.trace_url_template,
    )


def build_observability(engine: AsyncLLMEngine, settings: Settings, model: str) -> Observability:
    """Tracing (the process's provider, from OTEL_* variables; configured on first use) and a
    Prometheus registry shaped like the model: one `layer` per MoE layer (dense layers
    route nothing), one `expert` per routed expert."""
    if not settings.telemetry:
        return Observability.disabled()
    # Current HTTP semantic-convention names on the REST server span (read once, at the first
    # app built), unless the operator chose otherwise.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    args = engine.args
    metrics = ServiceMetrics(
        CollectorRegistry(),
        model,
        args.num_moe_layers,
        args.num_experts,
        engine.max_waiting,
        info={
            "dtype": engine.dtype,
            "device": engine.device,
            "quantization": engine.quantization,
            "kv_cache_dtype": engine.kv_cache_dtype,
        },
        weight_bytes=engine.weight_bytes,
        kv_cache_bytes=engine.kv_cache_bytes,
    )
    tokenizer = engine.tokenizer
    return Observability(
        model,
        metrics=metrics,
        tracer_provider=configure_tracing(),
        log_prompts=settings.log_prompts,
        decode=tokenizer.decode,
    )


async def _serve(settings: Settings) -> int:
    server = MoeServer(settings)
    try:
        await server.start()
    except (
        ModelLoadError,
        InvalidParameterError,
        KeysFileError,
        TlsConfigError,
        OSError,
        RuntimeError,
    ) as exc:
        log.error("startup failed", error=str(exc))
        if server.state is not None:
            await server.state.engine.shutdown()
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_shutdown)
    loop.add_signal_handler(signal.SIGHUP, server.reload_keys)
    return await server.run()


def serve(settings: Settings) -> int:
    configure_logging(settings.log_format)  # once for the process: service, engine, libraries
    try:
        return asyncio.run(_serve(settings))
    finally:
        if not shutdown_tracing(timeout_s=5.0):  # flush spans; a dead collector cannot hold exit
            log.warning("trace export did not finish before exit")
