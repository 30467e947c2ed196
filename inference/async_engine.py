"""AsyncLLMEngine: the engine loop on its own thread, per-request output streams on asyncio.

Requests and aborts reach the engine thread through a queue and are applied between steps;
outputs come back to the event loop in one callback per step. Each request's stream is a
single slot that merges deltas when its consumer lags, so no queue grows without bound.
Torch releases the GIL during kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import structlog

from inference.config import EngineConfig
from inference.engine import LLMEngine, Prompt
from inference.errors import EngineDeadError, InvalidParameterError, QueueFullError
from inference.outputs import RequestOutput, StepStats
from inference.sampling_params import SamplingParams

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
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_waiting = engine.config.max_waiting
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Callable[[StepStats], None]] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._error: BaseException | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str = "auto", **limits) -> AsyncLLMEngine:
        return cls(LLMEngine(path, device, dtype, EngineConfig.from_kwargs(**limits)))

    # ---- state read by the service ----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._inputs.qsize()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def kv_usage(self) -> float:
        return self.engine.block_manager.usage

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """listener(stats) runs on the event loop after every step; it must be quick."""
        self._listeners.append(listener)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- requests ---------------------------------------------------------------------------
    async def stream(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     log_context: dict | None = None,
                     prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens arrive (deltas in `delta_*`); aborts the request in the
        engine if the consumer stops early (disconnect, cancellation, deadline)."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        ids = prompt_token_ids if prompt_token_ids is not None else self.engine.tokenize_prompt(prompt, params)
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (max_waiting={self.max_waiting})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream()
        self._submit(("add", request_id, ids, params, log_context))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       log_context: dict | None = None) -> RequestOutput:
        output = None
        async for output in self.stream(prompt, params, request_id, log_context):
            pass
        return output

    def abort(self, request_id: str) -> None:
        """Frees the request's KV blocks before the next engine step."""
        self._submit(("abort", request_id))

    def _submit(self, item: tuple) -> None:
        self._inputs.put(item)
        self._wakeup.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _drain_inputs(self) -> None:
        while True:
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, rid, ids, params, log_context = item
                try:
                    self.engine.add_request(rid, None, params, log_context, prompt_token_ids=ids)
                except InvalidParameterError as exc:  # e.g. the id was reused meanwhile
                    self._call_soon(self._fail_stream, rid, exc)
            else:
                self.engine.abort(item[1])

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._drain_inputs()
                if not self.engine.has_unfinished and not self.engine.has_pending_stats:
                    self._wakeup.wait()
                    continue
                outputs, stats = self.engine.step()
                self._call_soon(self._deliver, outputs, stats)
        except BaseException as exc:  # the loop must never die silently
            self._error = exc
            log.exception("engine loop crashed")
            self._call_soon(self._fail_all, EngineDeadError(f"engine loop crashed: {exc!r}"))

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # event loop already closed (process shutting down)
            pass

    def _deliver(self, outputs: list[RequestOutput], stats: StepStats) -> None:
        for output in outputs:
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
