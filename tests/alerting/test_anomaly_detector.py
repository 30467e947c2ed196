"""Detector quality on synthetic series with known injected anomalies.

Univariate (RobustZDetector): noisy seasonal series with spikes, level shifts and slow
drifts injected after a clean reference stretch. Multivariate (IsolationForestScorer):
correlated load/queue/latency/KV series with broken correlations (TTFT up at normal
load), KV jumps and coherent load surges.

Recall is per injected event (detected when any point inside it is flagged); precision
is per flagged point (true when it lies inside an event, or within the EWMA's decay
tolerance after it). The figures are printed (run with -s to see them).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from telemetry.anomaly.detector import (
    DetectorConfig,
    IsolationForestScorer,
    RobustZDetector,
    anomaly_segments,
    ewma,
    robust_location_scale,
)

N, N_REF, TOLERANCE = 1000, 300, 15


def univariate_series(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    t = np.arange(N)
    x = 10 + 0.5 * np.sin(2 * np.pi * t / 200) + rng.normal(0, 1, N)
    kinds = ["spike", "shift", "drift"] * 2
    rng.shuffle(kinds)
    events, pos = [], N_REF + 20
    for kind in kinds:
        if kind == "spike":
            length = 1
            x[pos] += rng.choice([-1, 1]) * rng.uniform(5, 8)
        elif kind == "shift":
            length = int(rng.integers(20, 60))
            x[pos : pos + length] += rng.choice([-1, 1]) * rng.uniform(1.5, 3)
        else:
            length = int(rng.integers(60, 120))
            x[pos : pos + length] += np.linspace(0, rng.uniform(3, 5), length)
        events.append((kind, pos, pos + length - 1))
        pos += length + int(rng.integers(30, 60))
        if pos > N - 130:
            break
    return x, events


def evaluate(flags_and_events, tolerance: int) -> tuple[dict[str, float], float, int]:
    hits, total = Counter(), Counter()
    tp = fp = 0
    for flags, events in flags_and_events:
        inside = np.zeros(flags.size, dtype=bool)
        for kind, start, end in events:
            inside[start : end + 1 + tolerance] = True
            total[kind] += 1
            hits[kind] += bool(flags[start : end + 1].any())
        tp += int((flags & inside).sum())
        fp += int((flags & ~inside).sum())
    recall = {k: hits[k] / total[k] for k in total}
    recall["all"] = sum(hits.values()) / sum(total.values())
    return recall, tp / max(tp + fp, 1), fp


def test_robust_z_detector_precision_recall():
    det = RobustZDetector(DetectorConfig())
    runs = []
    for seed in range(50):
        x, events = univariate_series(np.random.default_rng(seed))
        runs.append((det.detect(x, N_REF), events))
    recall, precision, fp = evaluate(runs, TOLERANCE)
    clean_points = 50 * (N - N_REF)
    print(
        f"\nRobustZDetector: recall={ {k: round(v, 3) for k, v in recall.items()} } "
        f"point-precision={precision:.3f} false-positive points={fp} "
        f"(of ~{clean_points} scored points)"
    )
    assert recall["spike"] >= 0.9
    assert recall["shift"] >= 0.9
    assert recall["drift"] >= 0.95
    assert precision >= 0.95


def test_robust_z_detector_quiet_on_clean_series():
    det = RobustZDetector(DetectorConfig())
    rng = np.random.default_rng(123)
    flagged = 0
    for _ in range(20):
        x = 5 + rng.normal(0, 0.3, N)
        flagged += int(det.detect(x, N_REF).sum())
    print(f"\nclean series: {flagged} flagged points of {20 * N}")
    assert flagged / (20 * N) < 0.005


def multivariate_series(rng: np.random.Generator, n: int = 600, n_ref: int = 300):
    t = np.arange(n)
    load = 5 + 2 * np.sin(2 * np.pi * t / 150) + rng.normal(0, 0.3, n)
    running = load + rng.normal(0, 0.3, n)
    waiting = 2 * load + rng.normal(0, 0.5, n)
    ttft = 0.1 + 0.02 * waiting + rng.normal(0, 0.01, n)
    kv = 0.3 + 0.05 * load + rng.normal(0, 0.02, n)
    x = np.stack([running, waiting, ttft, kv], axis=1)
    events, pos = [], n_ref + 20
    for kind in ("decouple", "kv", "surge", "decouple", "kv"):
        length = int(rng.integers(5, 20))
        if kind == "decouple":  # TTFT up at normal load: inside TTFT's marginal range
            x[pos : pos + length, 2] += 0.08
        elif kind == "kv":
            x[pos : pos + length, 3] += 0.25
        else:  # a coherent load surge
            x[pos : pos + length] += np.array([6, 12, 0.24, 0.0])
        events.append((kind, pos, pos + length - 1))
        pos += length + int(rng.integers(20, 40))
    return x, events


def test_isolation_forest_precision_recall():
    scorer = IsolationForestScorer(n_estimators=100, seed=0)
    runs = []
    for seed in range(12):
        x, events = multivariate_series(np.random.default_rng(seed))
        runs.append((scorer.detect(x, 300), events))
    recall, precision, fp = evaluate(runs, 0)
    print(
        f"\nIsolationForest: recall={ {k: round(v, 3) for k, v in recall.items()} } "
        f"point-precision={precision:.3f} false-positive points={fp}"
    )
    assert recall["all"] >= 0.85
    assert recall["surge"] == 1.0
    assert precision >= 0.85


def test_isolation_forest_needs_residual_features_for_broken_correlations():
    """Without the residual features, TTFT-up-at-normal-load mostly goes unseen."""
    plain = IsolationForestScorer(residuals=False, seed=0)
    full = IsolationForestScorer(seed=0)
    runs_plain, runs_full = [], []
    for seed in range(6):
        x, events = multivariate_series(np.random.default_rng(seed))
        events = [e for e in events if e[0] == "decouple"]
        runs_plain.append((plain.detect(x, 300), events))
        runs_full.append((full.detect(x, 300), events))
    r_plain = evaluate(runs_plain, 0)[0]["decouple"]
    r_full = evaluate(runs_full, 0)[0]["decouple"]
    print(f"\ndecoupled TTFT recall: plain IF={r_plain:.2f} IF+residuals={r_full:.2f}")
    assert r_full > r_plain


def test_helpers():
    med, scale = robust_location_scale(np.array([1.0, 1.0, 1.0, 1.0]), min_scale=0.5)
    assert med == 1.0 and scale == 0.5  # flat reference: floored, never zero
    med, scale = robust_location_scale(np.array([np.nan, np.nan]))
    assert np.isnan(med)
    np.testing.assert_allclose(ewma(np.array([0.0, np.nan, 10.0]), 0.5, init=0.0), [0, 0, 5])
    assert anomaly_segments(np.array([0, 1, 1, 0, 0, 1, 0, 1], dtype=bool)) == [
        (1, 2),
        (5, 5),
        (7, 7),
    ]
    assert anomaly_segments(np.array([1, 0, 1], dtype=bool), min_gap=2) == [(0, 2)]


def test_spike_does_not_drag_the_ewma():
    """A single huge spike is one flagged point, not a flagged tail (Huber clip)."""
    x = np.full(200, 10.0) + np.random.default_rng(0).normal(0, 1, 200)
    x[150] += 50
    flags = RobustZDetector().detect(x, 100)
    assert flags[150]
    assert flags[151:].sum() == 0


@pytest.mark.parametrize("shift", [-3.0, 3.0])
def test_direction_of_a_level_shift(shift):
    x = np.random.default_rng(1).normal(0, 1, 300)
    x[200:] += shift
    s = RobustZDetector().score(x, 150)
    assert s.flags(4.0)[200:].mean() > 0.5
    assert np.sign(s.signed[250]) == np.sign(shift)
