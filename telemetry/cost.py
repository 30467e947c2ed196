"""What a million tokens cost on this server (SPEC section 13): `--cost-per-hour` over the
tokens it serves, as moeserve_cost_per_million_tokens{kind: output|total} and OpenCost's
llm_cost_per_million_tokens{model_name, cost_basis}.

The server costs its price whether busy or idle, so the rate is tokens over wall time: those
of the engine steps that ended in the last `window_s` seconds, over that window (or the time
since the collector began, when shorter). Output tokens are the tokens generated; total adds
the prompt tokens prefilled. With no token in the window the cost per token is undefined
(NaN).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

KINDS = ("output", "total")
WINDOW_S = 60.0


def cost_per_million_tokens(cost_per_hour: float, tokens_per_second: float) -> float:
    """USD per million tokens at `cost_per_hour` USD and `tokens_per_second` (NaN at 0)."""
    if tokens_per_second <= 0:
        return math.nan
    return cost_per_hour / 3600.0 / tokens_per_second * 1e6


class CostCollector(Collector):
    """Registered on the service's registry; `on_step` is an engine stats listener."""

    def __init__(
        self,
        model: str,
        cost_per_hour: float,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.cost_per_hour, self.window_s = model, cost_per_hour, window_s
        self._clock = clock
        self.began = clock()
        self._steps: deque[tuple[float, int, int]] = deque()  # (ended, output, total)
        self._lock = threading.Lock()  # steps come on the event loop, scrapes off it

    def on_step(self, stats: Any) -> None:
        generated = stats.num_generated_tokens
        total = generated + stats.num_prefill_tokens
        if total:
            with self._lock:
                self._steps.append((stats.started + stats.duration_s, generated, total))

    def tokens_per_second(self) -> dict[str, float]:
        """Output and total tokens per second of wall time over the window."""
        now = self._clock()
        start = max(now - self.window_s, self.began)
        with self._lock:
            while self._steps and self._steps[0][0] < start:
                self._steps.popleft()
            output = sum(s[1] for s in self._steps)
            total = sum(s[2] for s in self._steps)
        seconds = max(now - start, 1e-9)
        return {"output": output / seconds, "total": total / seconds}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rates = self.tokens_per_second()
        cost = {k: cost_per_million_tokens(self.cost_per_hour, rates[k]) for k in KINDS}
        ours = GaugeMetricFamily(
            "moeserve_cost_per_million_tokens",
            f"USD per million tokens at --cost-per-hour over the tokens served in the last "
            f"{self.window_s:g} s of wall time (kind: output tokens, or prompt and output "
            "tokens); NaN with none.",
            labels=("model", "kind"),
        )
        opencost = GaugeMetricFamily(
            "llm_cost_per_million_tokens",
            "OpenCost's name for moeserve_cost_per_million_tokens (cost_basis: output or total).",
            labels=("model_name", "cost_basis"),
        )
        for kind in KINDS:
            ours.add_metric((self.model, kind), cost[kind])
            opencost.add_metric((self.model, kind), cost[kind])
        yield ours
        yield opencost
