"""Shared by the inspector tests: a deterministic 429."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def engine_paused(core_pid: int) -> Iterator[None]:
    """The engine core process stopped (SIGSTOP) for the block: no step runs, so requests
    sent meanwhile stay waiting in the API process's queue, whatever the machine's speed;
    SIGCONT afterwards, also when the block fails."""
    os.kill(core_pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core_pid, signal.SIGCONT)
