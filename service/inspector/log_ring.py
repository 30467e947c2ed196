"""Recent log lines by trace id: the last `max_traces` traces, at most `max_lines` lines each.

Filled from any thread (telemetry.logging calls its sinks where the line is logged) and from
the engine core's lines shipped with its steps; read by the inspector's API.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class LogRing:
    def __init__(self, max_traces: int, max_lines: int = 200) -> None:
        self.max_traces, self.max_lines = max_traces, max_lines
        self._traces: OrderedDict[str, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, trace_id: str, line: str) -> None:
        """One JSON line (a telemetry.logging line sink)."""
        with self._lock:
            lines = self._traces.get(trace_id)
            if lines is None:
                lines = self._traces[trace_id] = []
                if len(self._traces) > self.max_traces:
                    self._traces.popitem(last=False)
            if len(lines) < self.max_lines:
                lines.append(line)

    def lines(self, trace_id: str) -> list[str]:
        with self._lock:
            return list(self._traces.get(trace_id, ()))

    def __len__(self) -> int:
        return len(self._traces)
