"""The engine core process: LLMEngine's step loop behind a pipe (vLLM v1's EngineCore).

AsyncLLMEngine starts it and talks to it with the messages below (msgspec msgpack, tagged
structs). In its own process the loop shares no GIL with the API server: the HTTP, SSE and
telemetry work of the event loop cannot stall a step between two kernels (on a small CPU
box such stalls also let the OpenMP workers fall asleep mid-step; bench/NOTES.md has the
measurements).

Inside the process a reader thread drains the pipe into a queue, so the API side never blocks
on a full pipe; requests and aborts are applied between steps, and each step's outputs and
stats go back as one message.
"""

from __future__ import annotations

import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import structlog
from safetensors import SafetensorError

from inference.config import EngineConfig
from inference.errors import InvalidParameterError, ModelLoadError
from inference.heap import freeze_startup_objects
from inference.kv_event_publisher import ZmqEventPublisher, start_publisher
from inference.kv_events import KVEventBatch, kv_events_config
from inference.outputs import RequestOutput, StepStats, wire_decoder, wire_encoder
from inference.sampling_params import SamplingParams
from inference.startup import PhaseMark, StartupClock

log = structlog.get_logger("inference.engine_core")


# ---- API process -> engine core ---------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    log_context: dict[str, Any] | None = None
    tenant: str | None = None


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = AddRequest | AbortRequest | Shutdown


# ---- engine core -> API process ---------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    device: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    weight_bytes: int  # resident weights (8-bit weights count their scales)
    kv_cache_tokens: int
    kv_cache_bytes: int
    startup: list[PhaseMark] = []  # the start's phases (inference/startup.py)


class PhaseStarted(msgspec.Struct, tag=True):
    """The start reached a phase (sent as it happens, before Ready)."""

    mark: PhaseMark


class StepResult(msgspec.Struct, tag=True):
    # without their prompt_token_ids (a 32K-token prompt is ~100 KB to encode every step):
    # AsyncLLMEngine.stream puts back the prompt it sent
    outputs: list[RequestOutput]
    stats: StepStats


class Rejected(msgspec.Struct, tag=True):
    """add_request refused the request (its stream fails with this error)."""

    request_id: str
    param: str
    message: str


class Failed(msgspec.Struct, tag=True):
    """The engine could not start, or its loop crashed: the process exits."""

    kind: str  # "model" | "parameter" | "other"
    message: str
    param: str = ""


FromCore = Ready | PhaseStarted | StepResult | Rejected | Failed


def failure(exc: BaseException) -> Failed:
    if isinstance(exc, InvalidParameterError):
        return Failed("parameter", exc.message, exc.param)
    if isinstance(exc, ModelLoadError):
        return Failed("model", str(exc))
    if isinstance(exc, SafetensorError):  # a weights file that does not parse: the model's fault
        return Failed("model", f"a weights file is not valid safetensors: {exc}")
    return Failed("other", f"{type(exc).__name__}: {exc}")


def spawn_engine_core(
    model_dir: str,
    device: str,
    dtype: str,
    config: EngineConfig,
    process_init: Callable[[], None] | None,
) -> tuple[subprocess.Popen, Connection]:
    """Starts `python -m inference.engine_core` on one end of a socket pair. A fresh
    interpreter rather than multiprocessing's spawn, which re-imports the caller's __main__
    (a script without a __main__ guard would start itself again). The core exits when its
    end of the pair closes, so it never outlives the API process."""
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", "inference.engine_core", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    conn = Connection(ours.detach())
    # the start-up arguments, pickled: process_init is any picklable callable
    conn.send_bytes(pickle.dumps((model_dir, device, dtype, config, process_init)))
    return process, conn


def main(fd: int) -> None:
    """The core process's entry point."""
    # Ctrl-C, or a SIGTERM sent to the whole group (systemd, a terminal), must not cut the
    # steps under a graceful drain, nor a SIGHUP (the API process's reload) kill the core:
    # the API process decides when the core stops.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    model_dir, device, dtype, config, process_init = pickle.loads(conn.recv_bytes())
    # process_init may return take_log_lines() (telemetry.logging.capture_request_lines)
    take_log_lines = process_init() if process_init is not None else None
    encoder = wire_encoder()
    from inference.engine import LLMEngine  # torch is imported here, after logging is set up

    clock = StartupClock(lambda mark: conn.send_bytes(encoder.encode(PhaseStarted(mark))))
    try:
        engine = LLMEngine(model_dir, device, dtype, config, clock)
    except Exception as exc:  # noqa: BLE001 - any start failure is reported to the API process
        conn.send_bytes(encoder.encode(failure(exc)))
        return
    try:  # vLLM's --kv-events-config: its sockets are bound before the core reports ready
        publisher = start_publisher(kv_events_config(config.kv_events_config))
    except InvalidParameterError as exc:
        conn.send_bytes(encoder.encode(failure(exc)))
        return
    if publisher is not None:
        engine.block_manager.record_events()
    freeze_startup_objects()  # the engine lives as long as this process
    conn.send_bytes(
        encoder.encode(
            Ready(
                engine.max_model_len,
                str(engine.device),
                str(engine.dtype).removeprefix("torch."),
                engine.quantization,
                engine.kv_cache_dtype,
                engine.weight_bytes,
                engine.kv_cache_tokens,
                engine.kv_cache_bytes,
                clock.marks,
            )
        )
    )
    take = take_log_lines if callable(take_log_lines) else None
    EngineCore(engine, conn, encoder, take, publisher).run()


class EngineCore:
    def __init__(
        self,
        engine,
        conn: Connection,
        encoder: msgspec.msgpack.Encoder,
        take_log_lines: Callable[[], list[tuple[str, str]]] | None = None,
        publisher: ZmqEventPublisher | None = None,
    ) -> None:
        """`take_log_lines()`: the request lines logged since its last call, shipped with
        each step's stats (StepStats.log_lines). `publisher`: where each step's KV-cache
        events go (queued: its own thread sends them)."""
        self.engine = engine
        self.publisher = publisher
        self.conn = conn
        self.encoder = encoder
        self.take_log_lines = take_log_lines
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.stopping = False
        # a grammar compiling off the step path wakes the loop when it is done
        engine.pending_grammars.on_done = self.wakeup.set

    def _read_inputs(self) -> None:
        decoder = wire_decoder(ToCore)
        try:
            while True:
                message = decoder.decode(self.conn.recv_bytes())
                self.inputs.put(message)
                self.wakeup.set()
                if isinstance(message, Shutdown):
                    return
        except (EOFError, OSError):  # the API process is gone: stop too
            self.inputs.put(Shutdown())
            self.wakeup.set()

    def _apply_inputs(self) -> None:
        while True:
            try:
                message = self.inputs.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                try:
                    self.engine.add_request(
                        message.request_id,
                        None,
                        message.params,
                        message.log_context,
                        prompt_token_ids=message.prompt_token_ids,
                        tenant=message.tenant,
                    )
                except InvalidParameterError as exc:
                    self._send(Rejected(message.request_id, exc.param, exc.message))
            elif isinstance(message, AbortRequest):
                self.engine.abort(message.request_id)
            else:
                self.stopping = True

    def _send(self, message: FromCore) -> None:
        self.conn.send_bytes(self.encoder.encode(message))

    def run(self) -> None:
        threading.Thread(target=self._read_inputs, name="engine-core-input", daemon=True).start()
        try:
            while True:
                self.wakeup.clear()
                self._apply_inputs()
                if self.stopping:
                    return
                for request_id, exc in self.engine.take_rejected():  # late grammar errors
                    self._send(Rejected(request_id, exc.param, exc.message))
                if not self.engine.has_unfinished and not self.engine.has_pending_stats:
                    self.wakeup.wait()
                    continue
                if self.engine.is_only_compiling:  # woken by the compile or new input
                    self.wakeup.wait()
                    continue
                outputs, stats = self.engine.step()
                if self.publisher is not None:
                    self._publish_kv_events()
                if self.take_log_lines is not None:
                    stats.log_lines = self.take_log_lines()
                for output in outputs:  # the API process has each prompt: it sent it
                    output.prompt_token_ids = []
                self._send(StepResult(outputs, stats))
        except (BrokenPipeError, EOFError):  # the API process is gone
            return
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop crashed")
            try:
                self._send(failure(exc))
            except OSError:
                pass
        finally:
            if self.publisher is not None:
                self.publisher.shutdown()

    def _publish_kv_events(self) -> None:
        events = self.engine.block_manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(time.time(), events))


if __name__ == "__main__":
    main(int(sys.argv[1]))
