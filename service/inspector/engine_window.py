"""The engine's last minutes in one-second buckets: step time, tokens and batch size for the
sparklines, routed tokens per MoE layer and expert for the heatmap.

Each step adds to the current bucket (the [layers, experts] counts as one numpy add, as
telemetry.expert_load does: 58 x 256 cells for DeepSeek-V3, no Python loop over them);
summing and filling the gaps happen when the page asks, every couple of seconds, not per
step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

SERIES_S = 120  # seconds of sparkline
HEATMAP_S = 60  # seconds of expert load in the heatmap


class _Second:
    __slots__ = ("batch", "busy_s", "experts", "generated", "prefill", "second", "steps")

    def __init__(self, second: int) -> None:
        self.second = second
        self.steps = self.batch = self.generated = self.prefill = 0
        self.busy_s = 0.0
        self.experts: np.ndarray | None = None  # [MoE layer, expert] routed tokens


class EngineWindow:
    """`num_layers` x `num_experts`: the model's MoE layers and routed experts (0 x 0 for a
    dense model)."""

    def __init__(self, num_layers: int, num_experts: int, seconds: int = SERIES_S) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.seconds = seconds
        self._buckets: deque[_Second] = deque(maxlen=seconds)

    def observe(self, stats: Any) -> None:
        """One StepStats with a batch (event loop, every step)."""
        second = stats.started_unix_ns // 1_000_000_000
        buckets = self._buckets
        if not buckets or buckets[-1].second != second:
            buckets.append(_Second(second))
        b = buckets[-1]
        b.steps += 1
        b.busy_s += stats.duration_s
        b.batch += stats.batch_size
        b.generated += stats.num_generated_tokens
        b.prefill += stats.num_prefill_tokens
        counts = stats.expert_tokens  # [MoE layer][expert], the model's shape
        if counts is None or not len(counts):
            return
        try:
            counts = np.asarray(counts, dtype=np.int64)
        except ValueError:  # ragged rows: not the model's shape
            return
        if counts.shape == (self.num_layers, self.num_experts):
            if b.experts is None:
                b.experts = counts.copy()
            else:
                b.experts += counts

    def series(self, now_s: float) -> dict[str, Any]:
        """The last `seconds` seconds up to `now_s` (Unix), one point per second."""
        end = int(now_s)
        start = end - self.seconds + 1
        by_second = {b.second: b for b in self._buckets if b.second >= start}
        points = [by_second.get(s) for s in range(start, end + 1)]
        return {
            "start": float(start),
            "step_ms": [_per_step(b, b and b.busy_s * 1e3) for b in points],
            "tokens_per_s": [b.generated if b else 0 for b in points],
            "prefill_tokens_per_s": [b.prefill if b else 0 for b in points],
            "batch_size": [_per_step(b, b and b.batch) for b in points],
        }

    def expert_counts(self, now_s: float, window_s: int = HEATMAP_S) -> np.ndarray:
        """[layer, expert] tokens routed in the last `window_s` seconds (zeros when idle)."""
        since = int(now_s) - window_s + 1
        total = np.zeros((self.num_layers, self.num_experts), np.int64)
        for b in list(self._buckets):
            if b.second >= since and b.experts is not None:
                total += b.experts
        return total

    def expert_tokens(self, now_s: float, window_s: int = HEATMAP_S) -> list[list[int]]:
        """expert_counts as [layer][expert] lists."""
        return self.expert_counts(now_s, window_s).tolist()


def _per_step(bucket: _Second | None, value: float | None) -> float | None:
    """The mean over the second's steps; None for a second without one."""
    if bucket is None or not bucket.steps:
        return None
    return round(value / bucket.steps, 3)
