"""The cost gauges' arithmetic with a fixed clock (the gauge against a real server's measured
throughput: tests/service/test_cost_metrics.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from telemetry.cost import CostCollector, cost_per_million_tokens


def step(ended: float, generated: int, prefill: int = 0, duration: float = 0.01):
    return SimpleNamespace(
        started=ended - duration,
        duration_s=duration,
        num_generated_tokens=generated,
        num_prefill_tokens=prefill,
    )


def test_cost_per_million_tokens():
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # $0.001/s over 1000 tok/s
    assert cost_per_million_tokens(2.0, 50.0) == pytest.approx(2.0 / 3600 / 50 * 1e6)
    assert math.isnan(cost_per_million_tokens(2.0, 0.0))


def test_rate_is_over_wall_time_in_the_window():
    now = [100.0]
    cost = CostCollector("m", 7.2, window_s=60.0, clock=lambda: now[0])
    registry = CollectorRegistry()
    registry.register(cost)

    def gauge(name, labels):
        return registry.get_sample_value(name, labels)

    assert math.isnan(gauge("moeserve_cost_per_million_tokens", {"model": "m", "kind": "output"}))
    cost.on_step(step(101.0, 40, prefill=60))
    cost.on_step(step(104.0, 40))
    now[0] = 110.0  # 80 output, 140 tokens in all over the 10 s since the collector began
    for kind, tokens in (("output", 80), ("total", 140)):
        expected = 7.2 / 3600 / (tokens / 10.0) * 1e6
        labels = {"model": "m", "kind": kind}
        assert gauge("moeserve_cost_per_million_tokens", labels) == pytest.approx(expected)
        opencost = {"model_name": "m", "cost_basis": kind}
        assert gauge("llm_cost_per_million_tokens", opencost) == pytest.approx(expected)
    now[0] = 162.0  # the first step left the window: 40 tokens over the last 60 s
    assert cost.tokens_per_second()["output"] == pytest.approx(40 / 60)
    now[0] = 300.0
    assert cost.tokens_per_second() == {"output": 0.0, "total": 0.0}
