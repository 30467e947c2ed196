"""moeserve_engine_decode_seconds_per_sequence: decode-only steps, per sequence of the batch
(the engine's speed on unchanged work, the webhook's step_time driver); steps carrying a
prefill chunk or a recompute are left out."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from telemetry.metrics import ServiceMetrics


def _step(duration_s: float, batch: int, prefill: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_running=batch, num_waiting=0, kv_usage=0.1, batch_size=batch, duration_s=duration_s,
        num_preemptions=0, expert_tokens=None, num_prefill_tokens=prefill,
        prefix_cache_queries=0, prefix_cache_hits=0,
    )  # fmt: skip


def test_only_decode_steps_are_observed_per_sequence():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "demo", 1, 2, 4)
    metrics.observe_step(_step(0.040, 8, 0))  # 5 ms per sequence
    metrics.observe_step(_step(0.012, 4, 0))  # 3 ms per sequence
    metrics.observe_step(_step(0.900, 8, 640))  # a prefill chunk: not the decode speed
    metrics.observe_step(_step(0.001, 0, 0))  # an empty step
    value = registry.get_sample_value
    labels = {"model": "demo"}
    name = "moeserve_engine_decode_seconds_per_sequence"
    assert value(f"{name}_count", labels) == 2
    assert abs(value(f"{name}_sum", labels) - 0.008) < 1e-9
    assert value(f"{name}_bucket", {**labels, "le": "0.004"}) == 1
    assert value("moeserve_engine_step_seconds_count", labels) == 4
