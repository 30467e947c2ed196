"""A supervisor for the server of a scenario, doing what docker compose's `restart:
unless-stopped` (deploy/docker-compose.yml) and a Kubernetes Deployment's `restartPolicy:
Always` (deploy/k8s/deployment.yaml) do: when the process exits without having been asked
to, it is started again, with the same arguments on the same port (compose: same
container name and port mapping; Kubernetes: same pod IP and containerPort). Restarts are
bounded (`max_restarts`), as compose's and the kubelet's back-off eventually stop a
crash loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Self

from bench.harness import ServerProcess


class Supervisor:
    """Runs `make()` (a ServerProcess, not started) and restarts it when it exits by itself.
    `current` is the live process, `restarts` the (exit code, seconds to ready) of each
    restart. A context manager: started and ready on entry, stopped on exit."""

    def __init__(
        self, make: Callable[[], ServerProcess], max_restarts: int = 3, poll_s: float = 0.1
    ) -> None:
        self.make, self.max_restarts, self.poll_s = make, max_restarts, poll_s
        self.current: ServerProcess | None = None
        self.restarts: list[dict[str, float | int | None]] = []
        self.retired: list[ServerProcess] = []  # earlier processes (their logs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supervisor")

    def __enter__(self) -> Self:
        self.current = self.make()
        self.current.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.current is not None:
            self.current.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            proc = self.current
            code = proc.poll() if proc is not None else None
            if code is None:
                continue
            if len(self.restarts) >= self.max_restarts:
                return
            exited_at = time.monotonic()
            proc.stop()
            self.retired.append(proc)
            fresh = self.make()
            fresh.start()
            try:
                fresh.wait_ready()
            except AssertionError:
                self.restarts.append({"exit_code": code, "ready_after_s": None})
                self.current = fresh
                continue
            self.restarts.append(
                {"exit_code": code, "ready_after_s": round(time.monotonic() - exited_at, 2)}
            )
            self.current = fresh

    @property
    def records(self) -> list[dict]:
        """The JSON log lines of every process so far."""
        out: list[dict] = []
        for proc in [*self.retired, self.current]:
            if proc is not None:
                out += proc.records
        return out
