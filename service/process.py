"""`moeserve serve` as a process: logging set up once for it, the server started (exit 2
when it cannot start), SIGTERM/SIGINT handed to its drain and SIGHUP to its key reload, the
trace export flushed at exit, and the server's exit status returned."""

from __future__ import annotations

import asyncio
import signal

from inference import InvalidParameterError, ModelLoadError
from inference.heap import freeze_startup_objects
from service.api_keys import KeysFileError
from service.server import MoeServer
from service.settings import Settings
from service.tls import TlsConfigError
from telemetry.genai_metrics import shutdown_meter_provider
from telemetry.logging import configure_logging, get_logger
from telemetry.tracing import shutdown_tracing

log = get_logger("service.server")  # the server's lines, whichever module logs them


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
    # One server for the process's life: the collector's full passes over what start-up left
    # (470k objects: the tokenizer, the metric registry..., GIL held, one pass every few thousand
    # tokens under load) stalled every stream; from here they walk only what serving makes.
    freeze_startup_objects()
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
        shutdown_meter_provider(timeout_s=5.0)  # the GenAI metrics' last export, if opted in
