"""Per-expert load of an MoE model as Prometheus samples, with cardinality bounded for
models of hundreds of experts (DeepSeek-V3: 58 MoE layers x 256 experts, Kimi-K2: 60 x 384).

What is exported (all built at scrape time, never on the engine's step path):
- moeserve_moe_expert_tokens_total{layer, expert}: routed tokens, a counter. While
  layers x experts fits `series_limit` (2048: every 8-64-expert model, Mixtral, OLMoE,
  Qwen2-MoE, DeepSeek-V2-Lite) `expert` is an expert id. Above it, contiguous experts share
  one series and `expert` names the range ("0-7", "8-15"...; inclusive), so a 256-expert
  model exports 58 x 32 series instead of 14,848. moeserve_moe_expert_bucket_size says how
  many experts one label holds.
- per layer, exact over all experts: moeserve_moe_expert_imbalance (max/mean load),
  moeserve_moe_expert_load_entropy (normalised Shannon entropy of the load), and the
  `hot_experts` most loaded experts by rank: moeserve_moe_hot_expert (the expert id) and
  moeserve_moe_hot_expert_load_ratio (its load / the mean load).
The full [layer, expert] matrix stays in the process: the inspector serves it (SGLang
likewise dumps its expert distribution rather than exporting a series per expert).

The per-layer gauges read a window counted in routed tokens, not steps: each step first
decays a layer's loads by exp(-routed / (window_tokens_per_expert x experts)), then adds
its counts. A step window sees too few tokens per expert at low load for max/mean to mean
anything with 256 experts (one decoding stream routes 8 tokens a step: 2 per expert over
64 steps, where a perfectly balanced router already reads ~4x); the token window always
holds about `window_tokens_per_expert` tokens per expert, however slow the traffic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "EXPERT_SERIES_LIMIT",
    "HOT_EXPERTS",
    "WINDOW_TOKENS_PER_EXPERT",
    "ExpertLoadCollector",
    "expert_bucket_size",
]

EXPERT_SERIES_LIMIT = 2048  # moeserve_moe_expert_tokens_total series per model, at most
HOT_EXPERTS = 3  # ranks of moeserve_moe_hot_expert per layer
WINDOW_TOKENS_PER_EXPERT = 64  # about this many routed tokens per expert in the window


def expert_bucket_size(num_layers: int, num_experts: int, series_limit: int) -> int:
    """Experts per `expert` label so that layers x labels <= series_limit: 1 while every
    expert fits, else the smallest divisor of num_experts that fits (equal buckets), or
    the least size that fits when no divisor is close (the last bucket is shorter)."""
    if num_layers * num_experts <= series_limit or num_experts <= 1:
        return 1
    max_buckets = max(1, series_limit // max(1, num_layers))
    least = -(-num_experts // max_buckets)
    for size in range(least, min(2 * least, num_experts + 1)):
        if num_experts % size == 0:
            return size
    return least


class ExpertLoadCollector(Collector):
    """Routed-token totals and windowed per-layer load of a [layers, experts] MoE model.

    `observe` takes a step's [MoE layer][expert] counts (nested lists, a numpy array or a
    CPU tensor) and does O(layers x experts) numpy work, no Python loop over the cells.
    One writer (the stats consumer); a scrape copies the arrays first, so it may see a
    step half-applied, never a decreasing counter.
    """

    def __init__(
        self,
        model: str,
        num_layers: int,
        num_experts: int,
        *,
        window_tokens_per_expert: int = WINDOW_TOKENS_PER_EXPERT,
        series_limit: int = EXPERT_SERIES_LIMIT,
        hot_experts: int = HOT_EXPERTS,
    ) -> None:
        if window_tokens_per_expert <= 0 or series_limit <= 0 or hot_experts < 0:
            raise ValueError("window, series limit and hot experts must be positive")
        self.model = model
        self.num_layers, self.num_experts = num_layers, num_experts
        self.window_tokens_per_expert = window_tokens_per_expert
        self.hot_experts = min(hot_experts, num_experts)
        self.bucket_size = expert_bucket_size(num_layers, num_experts, series_limit)
        self._starts = np.arange(0, num_experts, self.bucket_size)
        self.bucket_labels = [
            str(lo)
            if self.bucket_size == 1
            else f"{lo}-{min(lo + self.bucket_size, num_experts) - 1}"
            for lo in self._starts.tolist()
        ]
        self.totals = np.zeros((num_layers, num_experts), np.int64)
        self.window = np.zeros((num_layers, num_experts), np.float64)
        self._decay_per_token = -1.0 / (window_tokens_per_expert * max(1, num_experts))

    # ---------------------------------------------------------------- the step path
    def observe(self, expert_tokens: Any) -> None:
        counts = self._as_counts(expert_tokens)
        self.totals += counts
        routed = counts.sum(axis=1, keepdims=True)
        self.window *= np.exp(routed * self._decay_per_token)
        self.window += counts

    def _as_counts(self, expert_tokens: Any) -> np.ndarray:
        """[layers, experts] int64; other shapes clipped or padded with zeros, so the
        labels stay within the model's shape."""
        shape = (self.num_layers, self.num_experts)
        try:
            counts = np.asarray(expert_tokens, dtype=np.int64)
        except ValueError:  # ragged rows
            counts = None
        if counts is not None and counts.shape == shape:
            return counts
        out = np.zeros(shape, np.int64)
        for layer, row in enumerate(list(expert_tokens)[: self.num_layers]):
            row = np.asarray(row, dtype=np.int64).ravel()[: self.num_experts]
            out[layer, : row.size] = row
        return out

    # ---------------------------------------------------------------- derived views
    def bucket_totals(self) -> np.ndarray:
        """[layers, buckets] routed tokens since start-up (buckets of bucket_size)."""
        totals = self.totals.copy()
        if self.bucket_size == 1 or not totals.size:
            return totals
        return np.add.reduceat(totals, self._starts, axis=1)

    def layer_load(self) -> dict[str, np.ndarray]:
        """Per layer over the window: imbalance (max/mean), entropy (normalised, 1 =
        uniform), hot expert ids and their load / mean load ([layers, hot_experts]).
        A layer with nothing routed yet reads 0 everywhere and hot ids of -1."""
        window = self.window.copy()
        num_experts = max(1, self.num_experts)
        total = window.sum(axis=1)
        routed = total > 0
        safe_total = np.where(routed, total, 1.0)
        mean = safe_total / num_experts
        imbalance = np.where(routed, window.max(axis=1, initial=0.0) / mean, 0.0)
        share = window / safe_total[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(share > 0, share * np.log(share), 0.0)
        # one expert is trivially uniform
        uniformity = -plogp.sum(axis=1) / np.log(num_experts) if num_experts > 1 else 1.0
        entropy = np.where(routed, uniformity, 0.0)
        hot = np.argsort(-window, axis=1, kind="stable")[:, : self.hot_experts]
        ratio = np.take_along_axis(window, hot, axis=1) / mean[:, None]
        return {
            "imbalance": imbalance,
            "entropy": np.clip(entropy, 0.0, 1.0),
            "hot": np.where(routed[:, None], hot, -1),
            "hot_ratio": np.where(routed[:, None], ratio, 0.0),
        }

    # ---------------------------------------------------------------- Prometheus
    def _families(self) -> dict[str, Metric]:
        labels = ("model", "layer")
        return {
            "tokens": CounterMetricFamily(
                "moeserve_moe_expert_tokens",
                "Tokens routed to each expert (expert: an id, or an inclusive range lo-hi "
                "of moeserve_moe_expert_bucket_size experts when layers x experts exceeds "
                "the series limit).",
                labels=("model", "layer", "expert"),
            ),
            "bucket_size": GaugeMetricFamily(
                "moeserve_moe_expert_bucket_size",
                "Experts counted under one expert label of moeserve_moe_expert_tokens_total "
                "(1: a series per expert).",
                labels=("model",),
            ),
            "imbalance": GaugeMetricFamily(
                "moeserve_moe_expert_imbalance",
                f"Max/mean expert load per layer over a window of about "
                f"{self.window_tokens_per_expert} routed tokens per expert (1 = balanced, "
                "num_experts = one expert takes all; 0 = no tokens routed).",
                labels=labels,
            ),
            "entropy": GaugeMetricFamily(
                "moeserve_moe_expert_load_entropy",
                "Normalised entropy of a layer's expert load over the window (1 = uniform, "
                "towards 0 = a few experts take all; 0 = no tokens routed).",
                labels=labels,
            ),
            "hot": GaugeMetricFamily(
                "moeserve_moe_hot_expert",
                "Id of the layer's rank-th most loaded expert over the window (-1: no "
                "tokens routed).",
                labels=(*labels, "rank"),
            ),
            "hot_ratio": GaugeMetricFamily(
                "moeserve_moe_hot_expert_load_ratio",
                "Load of the layer's rank-th most loaded expert / the mean expert load, "
                "over the window.",
                labels=(*labels, "rank"),
            ),
        }

    def describe(self) -> Iterable[Metric]:
        return self._families().values()

    def collect(self) -> Iterable[Metric]:
        f = self._families()
        model = self.model
        f["bucket_size"].add_metric((model,), self.bucket_size)
        buckets = self.bucket_totals().tolist()
        load = {name: values.tolist() for name, values in self.layer_load().items()}
        ranks = [str(r + 1) for r in range(self.hot_experts)]
        for layer in range(self.num_layers):
            name = str(layer)
            for label, count in zip(self.bucket_labels, buckets[layer], strict=True):
                f["tokens"].add_metric((model, name, label), count)
            f["imbalance"].add_metric((model, name), load["imbalance"][layer])
            f["entropy"].add_metric((model, name), load["entropy"][layer])
            for rank, expert, ratio in zip(
                ranks, load["hot"][layer], load["hot_ratio"][layer], strict=True
            ):
                f["hot"].add_metric((model, name, rank), expert)
                f["hot_ratio"].add_metric((model, name, rank), ratio)
        return f.values()
