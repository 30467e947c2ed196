"""AsyncLLMEngine: the API process's handle on the engine core process, with per-request
output streams on asyncio.

The engine itself (weights, KV cache, scheduler) lives in a process of its own
(inference/engine_core.py); this side keeps the tokenizer and the model's config, validates
prompts before they cross, and learns the engine's state from each step's stats. A reader
thread turns the core's messages into one event-loop callback per step. Each request's stream
is a single slot that merges deltas when its consumer lags, so no queue grows without bound.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import structlog

from inference.config import EngineConfig
from inference.engine_core import (
    AbortRequest,
    AddRequest,
    Failed,
    FromCore,
    PhaseStarted,
    Ready,
    Rejected,
    Shutdown,
    StepResult,
    spawn_engine_core,
)
from inference.errors import EngineDeadError, InvalidParameterError, ModelLoadError, QueueFullError
from inference.executor.loader import load_hf_config, load_tokenizer
from inference.models.registry import model_args
from inference.outputs import RequestOutput, StepStats, wire_decoder, wire_encoder
from inference.prompts import Prompt, tokenize_prompt
from inference.sampling_params import SamplingParams
from inference.startup import PhaseMark

log = structlog.get_logger("inference.async_engine")


class RequestStream:
    """Single-slot output holder (vLLM's RequestOutputCollector)."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        pending = self._output
        if pending is not None:  # consumer lags: fold the older deltas into the new output
            for old, new in zip(pending.outputs, output.outputs):
                new.delta_text = old.delta_text + new.delta_text
                new.delta_token_ids = old.delta_token_ids + new.delta_token_ids
                new.delta_logprobs = old.delta_logprobs + new.delta_logprobs
        self._output = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        while True:
            if self._output is not None:
                output, self._output = self._output, None
                return output
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()


class AsyncLLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        config: EngineConfig | None = None,
        process_init: Callable[[], None] | None = None,
        on_startup_phase: Callable[[PhaseMark], None] | None = None,
    ) -> None:
        """Starts the engine core process and waits until it has loaded the model (blocking:
        call it off the event loop). `process_init` (picklable) runs first in that process,
        e.g. to configure logging the way the API process does; when it returns a callable,
        the core calls it after each step for (trace_id, line) pairs of request log lines to
        ship with the step's stats (StepStats.log_lines). `on_startup_phase` hears each phase
        the start reaches as it does (inference/startup.py); `startup` has them all after."""
        path = Path(model_dir)
        config = config or EngineConfig()
        self.max_waiting = config.max_waiting
        self.args = model_args(load_hf_config(path, config.hf_overrides))
        self.tokenizer = load_tokenizer(path)
        self._streams: dict[str, RequestStream] = {}
        self._unscheduled: set[str] = set()  # submitted, no output yet: the waiting queue
        self._listeners: list[Callable[[StepStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._stats: StepStats | None = None
        self._send_lock = threading.Lock()
        self._encoder = wire_encoder()
        self._decoder = wire_decoder(FromCore)
        self._process, self._conn = spawn_engine_core(
            str(path), device, dtype, config, process_init
        )
        ready = self._receive_start(on_startup_phase)
        self.startup: list[PhaseMark] = ready.startup
        self.max_model_len = ready.max_model_len
        self.device, self.dtype = ready.device, ready.dtype
        self.quantization, self.kv_cache_dtype = ready.quantization, ready.kv_cache_dtype
        self.weight_bytes = ready.weight_bytes
        self.kv_cache_tokens, self.kv_cache_bytes = ready.kv_cache_tokens, ready.kv_cache_bytes
        # the paged cache's shape (vLLM's cache_config_info reports it)
        self.block_size = config.block_size
        self.num_blocks = ready.kv_cache_tokens // config.block_size

    def _receive_start(self, on_phase: Callable[[PhaseMark], None] | None) -> Ready:
        while True:
            try:
                message = self._decoder.decode(self._conn.recv_bytes())
            except EOFError:
                self._conn.close()
                code = self._process.wait(10)
                raise ModelLoadError(
                    f"the engine process exited while starting (exit code {code})"
                ) from None
            if not isinstance(message, PhaseStarted):
                break
            if on_phase is not None:
                on_phase(message.mark)
        if isinstance(message, Failed):
            self._conn.close()
            self._process.wait(10)
            if message.kind == "parameter":
                raise InvalidParameterError(message.param, message.message)
            raise (ModelLoadError if message.kind == "model" else RuntimeError)(message.message)
        return message

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        process_init: Callable[[], None] | None = None,
        on_startup_phase: Callable[[PhaseMark], None] | None = None,
        **limits,
    ) -> AsyncLLMEngine:
        config = EngineConfig.from_kwargs(**limits)
        return cls(path, device, dtype, config, process_init, on_startup_phase)

    # ---- state read by the service (as of the last step) ------------------------------------
    @property
    def is_alive(self) -> bool:
        return (
            self._reader is not None
            and self._reader.is_alive()
            and self._process.poll() is None
            and self._error is None
            and not self._stopping
        )

    @property
    def num_waiting(self) -> int:
        return len(self._unscheduled)

    @property
    def num_running(self) -> int:
        return self._stats.num_running if self._stats else 0

    @property
    def num_requests(self) -> int:
        """Unfinished requests in the engine after its last step."""
        return self._stats.num_requests if self._stats else 0

    @property
    def kv_usage(self) -> float:
        return self._stats.kv_usage if self._stats else 0.0

    @property
    def kv_blocks_used(self) -> int:
        return self._stats.kv_blocks_used if self._stats else 0

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """listener(stats) runs on the event loop after every step; it must be quick."""
        self._listeners.append(listener)

    def remove_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        self._listeners.remove(listener)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="engine-core-output", daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        if not self._stopping:
            self._stopping = True
            try:
                self._send(Shutdown())
            except OSError:
                pass
        await asyncio.to_thread(self._stop_process)

    def _stop_process(self) -> None:
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            log.warning("engine process did not stop; killing it")
            self._process.kill()
            self._process.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        self._conn.close()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        return tokenize_prompt(
            self.tokenizer, self.args.vocab_size, self.max_model_len, prompt, params
        )

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        log_context: dict | None = None,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens arrive (deltas in `delta_*`); aborts the request in the
        engine if the consumer stops early (disconnect, cancellation, deadline). `tenant`
        tags the request for the scheduler's round-robin admission (LLMEngine.add_request)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        ids = (
            prompt_token_ids
            if prompt_token_ids is not None
            else self.tokenize_prompt(prompt, params)
        )
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting (max_waiting={self.max_waiting})"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream()
        self._unscheduled.add(request_id)
        finished = False
        try:
            try:
                self._send(AddRequest(request_id, ids, params, log_context, tenant))
            except OSError as exc:  # the core died just now; the reader has not noticed yet
                raise EngineDeadError(f"the engine process is gone: {exc!r}") from exc
            while not finished:
                output = await stream.get()
                output.prompt_token_ids = ids  # the core sends outputs without it
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            self._unscheduled.discard(request_id)
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        log_context: dict | None = None,
        tenant: str | None = None,
    ) -> RequestOutput:
        output = None
        async for output in self.stream(prompt, params, request_id, log_context, tenant=tenant):
            pass
        return output

    def abort(self, request_id: str) -> None:
        """Frees the request's KV blocks before the engine's next step."""
        try:
            self._send(AbortRequest(request_id))
        except OSError:  # the engine is gone: nothing left to free
            pass

    def _send(self, message) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:  # the event loop and gRPC threads may both submit
            self._conn.send_bytes(data)

    # ---- the engine's messages (reader thread -> event loop) ---------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self._decoder.decode(self._conn.recv_bytes())
                if isinstance(message, StepResult):
                    self._call_soon(self._deliver, message.outputs, message.stats)
                elif isinstance(message, Rejected):
                    error = InvalidParameterError(message.param, message.message)
                    self._call_soon(self._fail_stream, message.request_id, error)
                else:
                    self._died(f"engine loop crashed: {message.message}")
                    return
        except (EOFError, OSError):
            if not self._stopping:
                self._died(f"engine process exited (exit code {self._process.poll()})")

    def _died(self, reason: str) -> None:
        self._error = EngineDeadError(reason)
        log.error("engine process failed", reason=reason)
        self._call_soon(self._fail_all, self._error)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # event loop already closed (process shutting down)
            pass

    def _deliver(self, outputs: list[RequestOutput], stats: StepStats) -> None:
        self._stats = stats
        for output in outputs:
            self._unscheduled.discard(output.request_id)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # telemetry must never break serving
                log.exception("stats listener failed")

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
