"""Expert-load metrics at DeepSeek-V3 / Kimi-K2 scale: a synthetic stream of [58, 256]
routed-token counts through the real ServiceMetrics and its /metrics exposition."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from telemetry.expert_load import EXPERT_SERIES_LIMIT, ExpertLoadCollector, expert_bucket_size
from telemetry.metrics import ServiceMetrics, render_metrics

LAYERS, EXPERTS, TOP_K = 58, 256, 8  # DeepSeek-V3: 58 MoE layers route 8 of 256
HOT_LAYER, HOT_EXPERT = 3, 17
UNIFORM_LAYER = 5


def _stream(steps: int, seed: int = 0) -> list[np.ndarray]:
    """Per step [LAYERS, EXPERTS] counts of `tokens` tokens routed top-8: random experts,
    except HOT_LAYER (HOT_EXPERT takes one of each token's 8 slots) and UNIFORM_LAYER
    (every expert the same)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        tokens = 64 + 32 * (step % 3)
        counts = np.zeros((LAYERS, EXPERTS), np.int64)
        for layer in range(LAYERS):
            picks = rng.integers(0, EXPERTS, size=tokens * TOP_K)
            if layer == HOT_LAYER:
                picks[:tokens] = HOT_EXPERT
            counts[layer] = np.bincount(picks, minlength=EXPERTS)
        counts[UNIFORM_LAYER] = tokens * TOP_K // EXPERTS
        out.append(counts)
    return out


def _step(counts) -> SimpleNamespace:
    return SimpleNamespace(
        num_running=1, num_waiting=0, kv_usage=0.0, batch_size=1, duration_s=0.01,
        num_prefill_tokens=0, num_preemptions=0, expert_tokens=counts,
        prefix_cache_queries=0, prefix_cache_hits=0,
    )  # fmt: skip


def _samples(registry) -> dict[str, list]:
    body, _ = render_metrics(registry)
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def _reference_window(stream: list[np.ndarray], tokens_per_expert: int) -> np.ndarray:
    """The window's definition, step by step: decay by the tokens routed, then add."""
    window = np.zeros((LAYERS, EXPERTS))
    for counts in stream:
        for layer in range(LAYERS):
            routed = counts[layer].sum()
            window[layer] = window[layer] * math.exp(-routed / (tokens_per_expert * EXPERTS))
            window[layer] += counts[layer]
    return window


def test_58_by_256_stream_exports_bounded_series_with_correct_values():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "dsv3", LAYERS, EXPERTS, max_waiting=8)
    stream = _stream(12)
    for i, counts in enumerate(stream):  # the engine sends nested lists; arrays work too
        metrics.observe_step(_step(counts.tolist() if i % 2 else counts))
    samples = _samples(registry)

    moe_series = sum(len(s) for name, s in samples.items() if name.startswith("moeserve_moe_"))
    tokens = [s for s in samples["moeserve_moe_expert_tokens"] if s.name.endswith("_total")]
    assert len(tokens) == LAYERS * 32 <= EXPERT_SERIES_LIMIT  # 8 experts a series, not 14,848
    assert moe_series <= EXPERT_SERIES_LIMIT + LAYERS * (2 + 2 * 3) + 1
    (size,) = samples["moeserve_moe_expert_bucket_size"]
    assert size.value == 8

    total = np.sum(stream, axis=0)
    for s in tokens:
        layer = int(s.labels["layer"])
        lo, hi = (int(x) for x in s.labels["expert"].split("-"))
        assert hi - lo == 7
        assert s.value == total[layer, lo : hi + 1].sum()
    assert sum(s.value for s in tokens) == total.sum()

    window = _reference_window(stream, 64)
    by_layer = {
        name: {(s.labels["layer"], s.labels.get("rank")): s.value for s in samples[name]}
        for name in (
            "moeserve_moe_expert_imbalance",
            "moeserve_moe_expert_load_entropy",
            "moeserve_moe_hot_expert",
            "moeserve_moe_hot_expert_load_ratio",
        )
    }
    for layer in range(LAYERS):
        w = window[layer]
        imbalance = by_layer["moeserve_moe_expert_imbalance"][(str(layer), None)]
        assert imbalance == pytest.approx(w.max() / w.mean())
        share = w / w.sum()
        entropy = -(share[share > 0] * np.log(share[share > 0])).sum() / math.log(EXPERTS)
        assert by_layer["moeserve_moe_expert_load_entropy"][(str(layer), None)] == pytest.approx(
            entropy
        )
        hottest = by_layer["moeserve_moe_hot_expert"][(str(layer), "1")]
        assert w[int(hottest)] == w.max()
        ratio = by_layer["moeserve_moe_hot_expert_load_ratio"][(str(layer), "1")]
        assert ratio == pytest.approx(imbalance)
        ratios = [by_layer["moeserve_moe_hot_expert_load_ratio"][(str(layer), r)] for r in "123"]
        assert ratios == sorted(ratios, reverse=True)
    hot = str(HOT_LAYER)
    assert by_layer["moeserve_moe_hot_expert"][(hot, "1")] == HOT_EXPERT
    # one token slot in 8 goes to the hot expert: ~32x the mean of 256 experts
    assert by_layer["moeserve_moe_expert_imbalance"][(hot, None)] > 20
    uniform = str(UNIFORM_LAYER)
    assert by_layer["moeserve_moe_expert_imbalance"][(uniform, None)] == pytest.approx(1.0)
    assert by_layer["moeserve_moe_expert_load_entropy"][(uniform, None)] == pytest.approx(1.0)


def test_random_routing_reads_balanced_at_low_load():
    """A balanced router with one decoding stream (8 routed tokens a step) must not look
    imbalanced: the window holds ~64 tokens per expert however long that takes."""
    collector = ExpertLoadCollector("m", 1, EXPERTS)
    rng = np.random.default_rng(1)
    for _ in range(6000):
        collector.observe(np.bincount(rng.integers(0, EXPERTS, TOP_K), minlength=EXPERTS)[None])
    assert collector.layer_load()["imbalance"][0] < 2.0  # alert threshold: 3


@pytest.mark.parametrize(
    ("layers", "experts", "size", "buckets"),
    [
        (58, 256, 8, 32),  # DeepSeek-V3
        (60, 384, 12, 32),  # Kimi-K2
        (48, 128, 4, 32),  # Qwen3-30B-A3B
        (26, 64, 1, 64),  # DeepSeek-V2-Lite: a series per expert, as before
        (32, 8, 1, 8),  # Mixtral
        (10, 257, 6, 43),  # a prime count: the last bucket is shorter
    ],
)
def test_bucket_plans(layers, experts, size, buckets):
    limit = 2048 if experts != 257 else 512
    assert expert_bucket_size(layers, experts, limit) == size
    collector = ExpertLoadCollector("m", layers, experts, series_limit=limit)
    labels = collector.bucket_labels
    assert len(labels) == buckets and layers * buckets <= limit
    covered = []
    for label in labels:
        lo, _, hi = label.partition("-")
        covered.extend(range(int(lo), int(hi or lo) + 1))
    assert covered == list(range(experts))  # every expert in exactly one bucket


def test_idle_layers_and_ragged_input():
    collector = ExpertLoadCollector("m", 2, 4, hot_experts=2)
    load = collector.layer_load()
    assert load["imbalance"].tolist() == [0.0, 0.0] and load["hot"].tolist() == [[-1, -1]] * 2
    collector.observe([[0, 0, 6, 2, 99]])  # one layer, an extra expert: clipped and padded
    load = collector.layer_load()
    assert load["hot"].tolist() == [[2, 3], [-1, -1]]
    assert load["imbalance"][0] == pytest.approx(6 / 2)
    assert collector.totals.tolist() == [[0, 0, 6, 2], [0, 0, 0, 0]]
