"""Anomaly scoring of metric time series.

Two detectors, both fitted on a *reference* stretch of the series (the minutes before
an alert's onset) and applied to the whole series:

- ``RobustZDetector`` (univariate): a robust z-score per point against the reference
  median and MAD, combined with an EWMA control chart whose input is Huber-clipped so a
  single spike cannot drag it. The point score catches spikes, the EWMA score catches
  level shifts and slow drifts that stay inside the point band.
- ``IsolationForestScorer`` (multivariate, scikit-learn): an IsolationForest trained on
  the reference rows of all metrics, robustly standardised, flags time points whose
  joint configuration is unusual (for instance high TTFT with a normal queue).

Pure numpy/scikit-learn; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826
MEAN_ABS_TO_SIGMA = 1.2533
MAX_SCORE = 1e6


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    alpha: float = 0.2  # EWMA weight of the newest point
    threshold: float = 4.0  # robust z above which a point is anomalous
    clip: float = 4.0  # Huber clip (in reference sigmas) of the EWMA input
    rel_floor: float = 0.01  # scale floor relative to |reference median|
    min_scale: float = 0.0  # absolute scale floor, in the metric's unit

    def __post_init__(self) -> None:
        assert 0.0 < self.alpha <= 1.0, "alpha must be in (0, 1]"
        assert self.threshold > 0 and self.clip > 0
        assert self.rel_floor >= 0 and self.min_scale >= 0


def robust_location_scale(
    x: np.ndarray, rel_floor: float = 0.01, min_scale: float = 0.0
) -> tuple[float, float]:
    """Median and a robust sigma (MAD, else mean absolute deviation), floored > 0."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    med = float(np.median(x))
    dev = np.abs(x - med)
    scale = MAD_TO_SIGMA * float(np.median(dev))
    if scale <= 0.0:
        scale = MEAN_ABS_TO_SIGMA * float(np.mean(dev))
    scale = max(scale, rel_floor * abs(med), min_scale, 1e-12)
    return med, scale


def ewma(x: np.ndarray, alpha: float, init: float | None = None) -> np.ndarray:
    """Exponentially weighted moving average; NaNs carry the previous state forward."""
    x = np.asarray(x, dtype=float)
    out = np.empty_like(x)
    state = init
    for i, v in enumerate(x):
        if math.isfinite(v):
            state = v if state is None else alpha * v + (1.0 - alpha) * state
        out[i] = math.nan if state is None else state
    return out


@dataclass(frozen=True, slots=True)
class SeriesScore:
    """Per-point scores of one series; ``score`` is the max of both detectors (>= 0)."""

    score: np.ndarray
    signed: np.ndarray  # the dominating z with its sign (direction of the move)
    median: float
    scale: float

    def flags(self, threshold: float) -> np.ndarray:
        return self.score >= threshold


class RobustZDetector:
    """Robust z-score + Huber-clipped EWMA chart, fitted on a reference stretch."""

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()

    def score(self, values: np.ndarray, n_reference: int) -> SeriesScore:
        cfg = self.config
        x = np.asarray(values, dtype=float)
        n_reference = max(1, min(int(n_reference), x.size))
        med, scale = robust_location_scale(x[:n_reference], cfg.rel_floor, cfg.min_scale)
        if not math.isfinite(med):
            zeros = np.zeros_like(x)
            return SeriesScore(zeros, zeros, med, scale)
        z_point = (x - med) / scale
        clipped = med + np.clip(z_point, -cfg.clip, cfg.clip) * scale
        smooth = ewma(clipped, cfg.alpha, init=med)
        # iid noise gives the EWMA a sigma of scale*sqrt(a/(2-a)); autocorrelated noise
        # (scraped gauges, rate() windows overlapping query steps) gives more: take the
        # larger of that and the EWMA's own robust spread over the reference.
        ewma_sigma = scale * math.sqrt(cfg.alpha / (2.0 - cfg.alpha))
        ref_smooth = smooth[:n_reference]
        ref_smooth = ref_smooth[np.isfinite(ref_smooth)]
        if ref_smooth.size >= 10:
            spread = MAD_TO_SIGMA * float(np.median(np.abs(ref_smooth - med)))
            ewma_sigma = max(ewma_sigma, spread)
        z_level = (smooth - med) / ewma_sigma
        z_point = np.nan_to_num(z_point, nan=0.0)
        z_level = np.nan_to_num(z_level, nan=0.0)
        use_point = np.abs(z_point) >= np.abs(z_level)
        signed = np.clip(np.where(use_point, z_point, z_level), -MAX_SCORE, MAX_SCORE)
        return SeriesScore(np.abs(signed), signed, med, scale)

    def detect(self, values: np.ndarray, n_reference: int) -> np.ndarray:
        return self.score(values, n_reference).flags(self.config.threshold)


class IsolationForestScorer:
    """Multivariate anomaly scores from an IsolationForest fitted on reference rows.

    ``matrix`` is (time points x metrics); NaNs are replaced by the metric's reference
    median. Scores follow Liu et al.: s in (0, 1], higher is more anomalous; a point is
    flagged when s exceeds both ``min_score`` and the ``quantile`` of reference scores
    plus ``margin``.
    """

    def __init__(
        self,
        n_estimators: int = 100,
        min_score: float = 0.6,
        quantile: float = 0.99,
        margin: float = 0.02,
        clip: float = 50.0,
        residuals: bool = True,
        seed: int = 0,
    ) -> None:
        self.residuals = residuals
        self.n_estimators = n_estimators
        self.min_score = min_score
        self.quantile = quantile
        self.margin = margin
        self.clip = clip
        self.seed = seed

    def standardise(self, matrix: np.ndarray, n_reference: int) -> np.ndarray:
        m = np.asarray(matrix, dtype=float)
        out = np.zeros_like(m)
        for j in range(m.shape[1]):
            med, scale = robust_location_scale(m[:n_reference, j])
            if not math.isfinite(med):
                continue
            col = np.where(np.isfinite(m[:, j]), m[:, j], med)
            out[:, j] = np.clip((col - med) / scale, -self.clip, self.clip)
        return out

    def features(self, matrix: np.ndarray, n_reference: int) -> np.ndarray:
        """Standardised metrics plus, per metric, the standardised residual of a
        least-squares fit on the other metrics over the reference rows: an
        IsolationForest alone misses broken correlations (high TTFT at normal load)."""
        z = self.standardise(matrix, n_reference)
        if not self.residuals or z.shape[1] < 2:
            return z
        ref = z[:n_reference]
        cols = [z]
        for j in range(z.shape[1]):
            others = np.delete(z, j, axis=1)
            design = np.column_stack([others, np.ones(len(z))])
            coef, *_ = np.linalg.lstsq(design[:n_reference], ref[:, j], rcond=None)
            resid = z[:, j] - design @ coef
            med, scale = robust_location_scale(resid[:n_reference])
            cols.append(np.clip((resid - med) / scale, -self.clip, self.clip)[:, None])
        return np.hstack(cols)

    def score(self, matrix: np.ndarray, n_reference: int) -> tuple[np.ndarray, float]:
        """Anomaly score per row and the flagging threshold."""
        from sklearn.ensemble import IsolationForest  # heavy import, only when used

        n_reference = max(2, min(int(n_reference), len(matrix)))
        z = self.features(matrix, n_reference)
        n_reference = max(2, min(int(n_reference), z.shape[0]))
        forest = IsolationForest(
            n_estimators=self.n_estimators,
            max_samples=min(256, n_reference),
            random_state=self.seed,
        ).fit(z[:n_reference])
        scores = -forest.score_samples(z)
        ref_q = float(np.quantile(scores[:n_reference], self.quantile))
        return scores, max(self.min_score, ref_q + self.margin)

    def detect(self, matrix: np.ndarray, n_reference: int) -> np.ndarray:
        scores, threshold = self.score(matrix, n_reference)
        return scores >= threshold


def anomaly_segments(flags: np.ndarray, min_gap: int = 1) -> list[tuple[int, int]]:
    """Contiguous runs of True as inclusive (start, end) index pairs; runs separated
    by fewer than ``min_gap`` False points are merged."""
    segments: list[tuple[int, int]] = []
    idx = np.flatnonzero(np.asarray(flags, dtype=bool))
    for i in idx:
        i = int(i)
        if segments and i - segments[-1][1] <= min_gap:
            segments[-1] = (segments[-1][0], i)
        else:
            segments.append((i, i))
    return segments
