"""What the scenarios inject, and what they watch the server with:

- `CpuHog`: busy-looping processes beside the server (the noisy neighbour).
- `OtlpSink`: an OTLP/gRPC trace collector on 127.0.0.1 that the server exports to; it can
  go down (its port closed: exports fail) and come back slow (each export waits).
- `kill_engine_core`: SIGKILL to the server's engine core process.
- `RssSampler`: resident memory of the server and its children, sampled on a thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Self

from bench.harness import HOST, ServerProcess, child_pids, free_port

HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


class CpuHog:
    """`n` processes spinning on the CPU at the server's priority, for at most `max_s`
    seconds each (they stop by themselves even if the harness dies)."""

    def __init__(self, n: int, max_s: float) -> None:
        self.n, self.max_s = n, max_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Self:
        code = HOG.format(s=self.max_s)
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs = []


class OtlpSink:
    """A gRPC OTLP trace receiver on a fixed free port: `up()` (answers at once), `slow(s)`
    (answers after `s` seconds), `down()` (port closed). Counts the spans it received."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.delay_s = 0.0
        self.spans = 0
        self._server = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        sink = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # the gRPC method's name
                if sink.delay_s:
                    time.sleep(sink.delay_s)
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        server.add_insecure_port(f"{HOST}:{self.port}")
        server.start()
        self._server = server

    def up(self) -> None:
        self.delay_s = 0.0
        if self._server is None:
            self._start()

    def slow(self, delay_s: float) -> None:
        self.delay_s = delay_s
        if self._server is None:
            self._start()

    def down(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.delay_s = 0.0
        self.down()


def kill_engine_core(server: ServerProcess) -> int:
    """SIGKILLs the engine core of `server` (as the OOM killer would); returns its pid."""
    pid = server.engine_core_pid()
    assert pid is not None, "the server has no engine core process"
    os.kill(pid, signal.SIGKILL)
    return pid


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (bytes; 0 when gone)."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class RssSampler:
    """Samples `rss_bytes` of a server every `period_s` on a daemon thread; `samples` are
    (seconds since start, bytes). `pid` is read on each sample (a restarted server)."""

    def __init__(self, pid_of, period_s: float = 1.0) -> None:
        self.pid_of, self.period_s = pid_of, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            pid = self.pid_of()
            if pid:
                self.samples.append((time.monotonic() - self._t0, rss_bytes(pid)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)
