"""The one process harness and the one SSE reader of the tests and the benchmarks.

- `ManagedProcess`: a child process whose stdout and stderr go to one log file, stopped with
  SIGTERM and then, after a bounded wait, SIGKILL (Prometheus, Alertmanager, peer servers).
- `ServerProcess`: `moeserve serve` (`python -m service.cli serve`) on 127.0.0.1, its REST port
  (and, with `grpc=True`, its gRPC port) free ones, ready once it logs "server started"; its JSON
  log lines are `records`. A context manager: started and waited for on entry, stopped on exit.
- `InProcessServer`: the same server in this process, on an event loop of its own thread, for
  tests that look at the engine object too.
- `prometheus_process(...)`: the Prometheus the integration tests scrape with.
- `wait_for_http(url, timeout)`: polls a URL until it answers (any process, peers included).
- `iter_sse` / `aiter_sse` / `read_sse`: OpenAI-style server-sent events, `data: {json}` lines
  up to a final `data: [DONE]`; anything else raises `SseError`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Self

import httpx

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may still take it before it is used)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (httpx.HTTPError,),
) -> Any:
    """Calls `predicate` until it returns something truthy and returns that; an exception of
    `retry_on` counts as "not yet". AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}"
                + (f" (last error: {last!r})" if last else "")
            )
        time.sleep(interval)


class ManagedProcess:
    """A child process, its stdout and stderr in one log file: `log_path`, or a temporary file
    removed by `stop` (the text read so far stays in `lines`). `stop` sends SIGTERM, then SIGKILL
    after `stop_timeout` seconds; with `new_session` the process leads a process group of its own
    and the signals go to the whole group (servers that start workers of their own)."""

    def __init__(
        self,
        argv: Iterable[str | os.PathLike],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike = REPO,
        log_path: str | os.PathLike | None = None,
        new_session: bool = False,
        stop_timeout: float = 30.0,
        name: str | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name or Path(self.argv[0]).name  # for messages
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.log_path = None if log_path is None else Path(log_path)
        self.new_session = new_session
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []  # complete lines of the log read so far
        self._own_log = log_path is None
        self._reader = None
        self._partial = ""
        self._lock = threading.Lock()

    def start(self) -> Self:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{Path(self.argv[0]).name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with self.log_path.open("wb") as out:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
            )
        self._reader = self.log_path.open(encoding="utf-8", errors="replace")
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float | None = None) -> int | None:
        """Stops the process (if it still runs) and returns its exit code; safe to call twice."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        with self._lock:
            if self._reader is not None:
                self._read_locked()
                if self._partial:
                    self._add([self._partial])
                    self._partial = ""
                self._reader.close()
                self._reader = None
                if self._own_log:
                    self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def read(self) -> None:
        """Takes in what the process wrote to its log since the last call."""
        with self._lock:
            self._read_locked()

    def _read_locked(self) -> None:
        if self._reader is None:
            return
        chunk = self._reader.read()
        if chunk:
            *complete, self._partial = (self._partial + chunk).split("\n")
            self._add([line + "\n" for line in complete])

    def _add(self, lines: list[str]) -> None:
        self.lines.extend(lines)

    def log_text(self) -> str:
        self.read()
        return "".join(self.lines) + self._partial

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


def prometheus_process(
    binary: str, config: Path, workdir: Path, port: int, stop_timeout: float = 10.0
) -> ManagedProcess:
    """Prometheus (exemplar storage on) with `config`, its TSDB and log under `workdir`,
    listening on 127.0.0.1:`port`; not started yet."""
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={HOST}:{port}",
        "--enable-feature=exemplar-storage",
        "--log.level=warn",
    ]
    return ManagedProcess(
        argv, cwd=workdir, log_path=workdir / "prometheus.log", stop_timeout=stop_timeout
    )


def wait_for_http(
    url: str,
    timeout: float,
    *,
    process: ManagedProcess | None = None,
    ready: Callable[[httpx.Response], Any] = lambda r: r.status_code == 200,
    interval: float = 0.2,
) -> httpx.Response:
    """GETs `url` until `ready(response)` holds and returns that response; connection errors and
    bodies `ready` cannot parse (ValueError) count as "not yet". RuntimeError, with the log tail
    of `process`, when `process` exits first or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    with httpx.Client(timeout=5) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{process.name} exited ({process.poll()}) before {url} answered; "
                    f"log {process.log_path}:\n{process.tail()}"
                )
            try:
                r = client.get(url)
                if ready(r):
                    return r
                last = f"HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                where = f"; log {process.log_path}:\n{process.tail()}" if process else ""
                raise RuntimeError(f"{url} not ready after {timeout}s (last: {last}){where}")
            time.sleep(interval)


def _server_env(extra: Mapping[str, str | None] | None) -> dict[str, str]:
    """The caller's environment without the MOESERVE_<FLAG> variables `serve` would read as flag
    defaults (the server's settings are its arguments and `extra`), plus `extra` (None unsets)."""
    from service.settings import Settings

    flags = {"MOESERVE_" + f.name.upper() for f in fields(Settings)}
    env = {k: v for k, v in os.environ.items() if k not in flags}
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class ServerProcess(ManagedProcess):
    """`moeserve serve --model MODEL ARGS...` as `python -m service.cli serve` on 127.0.0.1 with
    JSON logs; REST on `port` (0: a free one), gRPC on a free port with `grpc=True`, none without.
    Ready when it logs "server started" (`started`, which names the ports it bound); `records` are
    its JSON log lines. As a context manager it is started and waited for (`start_timeout`) on
    entry and stopped on exit; `start()` and `wait_ready()` do it in two steps."""

    def __init__(
        self,
        model: str | os.PathLike,
        *args: str | int | os.PathLike,
        port: int = 0,
        grpc: bool = False,
        api_key: str | None = None,
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike | None = None,
        start_timeout: float = 180.0,
        stop_timeout: float = 30.0,
    ) -> None:
        argv = [
            sys.executable, "-m", "service.cli", "serve", "--model", model, "--host", HOST,
            "--port", port, "--grpc-port", 0 if grpc else -1, "--log-format", "json",
            *(["--api-key", api_key] if api_key else []), *args,
        ]  # fmt: skip
        super().__init__(argv, env=_server_env(env), log_path=log_path, stop_timeout=stop_timeout)
        self.api_key = api_key
        self.start_timeout = start_timeout
        self.rest_port: int | None = port or None
        self.grpc_port: int | None = None
        self.started: dict[str, Any] | None = None  # the "server started" log line
        self._records: list[dict[str, Any]] = []

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Waits for the "server started" line (AssertionError with the log tail if the server
        exits first or `timeout`, default `start_timeout`, runs out) and returns it."""
        timeout = self.start_timeout if timeout is None else timeout
        self.started = self.wait_for_event("server started", timeout)
        self.rest_port = int(self.started["rest_port"])
        self.grpc_port = self.started.get("grpc_port")
        return self.started

    @property
    def url(self) -> str:
        """http://, or https:// for a server given --ssl-certfile."""
        scheme = "https" if "--ssl-certfile" in self.argv else "http"
        return f"{scheme}://{HOST}:{self.rest_port}"

    @property
    def grpc_target(self) -> str:
        assert self.grpc_port, "no gRPC server (grpc=False or not started yet)"
        return f"{HOST}:{self.grpc_port}"

    @property
    def model(self) -> str:
        """The served model name, as the "server started" line gives it."""
        return self.started["model"]

    def _add(self, lines: list[str]) -> None:
        super()._add(lines)
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self._records.append(record)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The JSON log lines so far (a copy)."""
        self.read()
        return list(self._records)

    def wait_for(
        self, predicate: Callable[[dict], Any], count: int = 1, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """The log records matching `predicate` once there are `count` of them; AssertionError
        with the log tail after `timeout` seconds or when the server exits short of them."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None  # before reading: then all of its output is in
            found = [r for r in self.records if predicate(r)]
            if len(found) >= count:
                return found
            if exited or time.monotonic() > deadline:
                state = f"exited ({self.proc.returncode})" if exited else f"waited {timeout}s"
                raise AssertionError(
                    f"{len(found)}/{count} matching log lines from moeserve ({state}); "
                    f"log tail:\n{self.tail(60)}"
                )
            time.sleep(0.05)

    def wait_for_event(self, event: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first log record whose "event" is `event`."""
        return self.wait_for(lambda r: r.get("event") == event, timeout=timeout)[0]

    def engine_core_pid(self) -> int | None:
        """The pid of the server's engine core process (`python -m inference.engine_core`),
        None when it has none (not started yet, or gone)."""
        for pid in child_pids(self.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"inference.engine_core" in cmdline:
                return pid
        return None


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (Linux /proc; [] when it is gone)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


# --- server-sent events -------------------------------------------------------------------


class InProcessServer:
    """`service.server.MoeServer` (engine, REST, and gRPC when the settings give a port) on
    its own event loop in a background thread, so a test can also look at the engine object
    directly. A context manager; `finished` lists (engine request id, finish reason)."""

    def __init__(self, settings) -> None:
        from service.server import MoeServer  # the engine's imports only where it is used

        self.settings = settings
        self.server = MoeServer(settings)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code: int | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.finished: list[tuple[str, str]] = []  # (engine request id, finish reason), in order
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await self.server.start()
        except BaseException as exc:  # noqa: BLE001 - handed to __enter__, raised there
            self._error = exc
            self._started.set()
            return
        self.server.state.engine.add_stats_listener(
            lambda stats: self.finished.extend(
                (f.request_id, f.finish_reason) for f in stats.finished
            )
        )
        run = asyncio.ensure_future(self.server.run())
        while not self.server._uvicorn.started and not run.done():
            await asyncio.sleep(0.01)
        self._started.set()
        self.exit_code = await run

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._started.wait(120):
            raise TimeoutError("server did not start within 120 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread.is_alive():  # not when it has exited by itself (its engine died)
            try:
                self.loop.call_soon_threadsafe(self.server.request_shutdown)
            except RuntimeError:  # its loop closed meanwhile
                pass
        self._thread.join(30)
        assert not self._thread.is_alive(), "server thread did not stop"

    @property
    def url(self) -> str:
        """http://, or https:// for a server with TLS."""
        scheme = "https" if self.settings.ssl_certfile else "http"
        return f"{scheme}://{HOST}:{self.server.rest_port}"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.server.grpc_port}"

    @property
    def state(self):
        return self.server.state

    @property
    def engine(self):
        return self.server.state.engine


class SseError(AssertionError):
    """A stream that is not `data: {JSON object}` events ending with `data: [DONE]`."""


def decode_sse(line: str | bytes) -> dict[str, Any] | None:
    """The JSON object of one `data: ` line, None for `data: [DONE]`; SseError otherwise."""
    if isinstance(line, bytes):
        line = line.decode()
    if not line.startswith("data: "):
        raise SseError(f"not an SSE data line: {line[:300]!r}")
    payload = line[6:]
    if payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        raise SseError(f"SSE data is not JSON: {line[:300]!r}") from None
    if not isinstance(event, dict):
        raise SseError(f"SSE data is not a JSON object: {line[:300]!r}")
    return event


class _StreamRule:
    """The rule both readers apply line by line: blank lines skipped, `data: [DONE]` last."""

    def __init__(self) -> None:
        self.done = False

    def event(self, line: str | bytes) -> dict[str, Any] | None:
        if not line:
            return None
        if self.done:
            raise SseError(f"{line[:300]!r} after data: [DONE]")
        event = decode_sse(line)
        self.done = event is None
        return event

    def close(self) -> None:
        if not self.done:
            raise SseError("the stream ended without data: [DONE]")


def iter_sse(lines: Iterable[str | bytes]) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival time on time.perf_counter, event) for each event of a stream given as its lines
    (e.g. `response.iter_lines()`), as they come; `data: [DONE]` must be the last line but blank
    ones: SseError when anything follows it or the stream ends without it."""
    rule = _StreamRule()
    for line in lines:
        event = rule.event(line)
        if event is not None:
            yield time.perf_counter(), event
    rule.close()


async def aiter_sse(lines: AsyncIterable[str | bytes]) -> AsyncIterator[tuple[float, dict]]:
    """`iter_sse` over an async iterable of lines (e.g. `response.aiter_lines()`)."""
    rule = _StreamRule()
    async for line in lines:
        event = rule.event(line)
        if event is not None:
            yield time.perf_counter(), event
    rule.close()


def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    """Every event of a streamed httpx response, read to its end (`data: [DONE]` checked)."""
    return [event for _, event in iter_sse(response.iter_lines())]
