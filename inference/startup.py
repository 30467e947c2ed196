"""Start-up phases as plain data: where a start's time went (SPEC section 13).

The engine marks the start of each phase on a StartupClock as it reaches it; a phase lasts
until the next mark, so the marks partition the start without gaps. The same phase may be
marked more than once (our CPU kernels are built before the weights are packed, torch.compile
wraps the model after the KV cache is allocated): its time is the sum. The service exports
them (metrics, a "startup" trace, log lines, /ready); this package only records them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

# in the order a start usually goes through them; "ready" is the service's own (the API
# built and its listeners started around the loaded engine)
PHASES = ("load_weights", "quantize", "pack", "kv_cache_alloc", "compile", "warmup", "ready")


class PhaseMark(msgspec.Struct, array_like=True):
    """`phase` starts at `at` (time.monotonic(): one clock for every process of the host)."""

    phase: str
    at: float


class StartupClock:
    """The marks of one start; `on_mark` hears each as it is made (the engine core sends
    them to the API process, so /ready can say which phase it is in)."""

    def __init__(self, on_mark: Callable[[PhaseMark], None] | None = None) -> None:
        self.marks: list[PhaseMark] = []
        self.on_mark = on_mark

    def mark(self, phase: str) -> None:
        if phase not in PHASES:  # a wiring bug: the names are fixed by the spec
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        mark = PhaseMark(phase, time.monotonic())
        self.marks.append(mark)
        if self.on_mark is not None:
            self.on_mark(mark)


def phase_seconds(marks: list[PhaseMark], end: float) -> dict[str, float]:
    """Seconds in each phase (the PHASES not marked: 0), the last one lasting until `end`."""
    seconds = dict.fromkeys(PHASES, 0.0)
    for mark, following in zip(marks, [*marks[1:], PhaseMark("", end)], strict=True):
        seconds[mark.phase] += max(following.at - mark.at, 0.0)
    return seconds


def phase_order(marks: list[PhaseMark]) -> list[str]:
    """The phases in the order the start first reached them."""
    return list(dict.fromkeys(m.phase for m in marks))
