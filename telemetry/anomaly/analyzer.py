"""Turns one firing alert into an incident: pull the key series around the alert from
Prometheus, score them, rank what moved and the causes it implicates (causes.py), and
attach exemplar trace ids."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .causes import rank_causes
from .config import WebhookSettings
from .detector import DetectorConfig, IsolationForestScorer, RobustZDetector
from .prometheus_api import PrometheusAPI, PrometheusError, RangeSeries
from .schemas import AlertmanagerAlert, Exemplar, Incident, MetricScore

# Alert labels that also label the service's series, used to narrow the queries.
FILTER_LABELS = ("job", "instance", "model")
TRACE_ID_KEYS = ("trace_id", "traceID", "traceId", "trace-id")
MIN_REFERENCE_POINTS = 5
_REACHED_ENGINE = 'finish_reason!="none"'  # requests_total of requests the engine finished


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(labels: dict[str, str], *, raw: str = "", **extra: str) -> str:
    """PromQL label selector ``{a="b",...}`` with values escaped; `raw` is one more matcher
    written as is (e.g. ``finish_reason!="none"``)."""
    items = {**labels, **extra}
    matchers = [f'{k}="{_escape(v)}"' for k, v in sorted(items.items())] + ([raw] if raw else [])
    return "{" + ",".join(matchers) + "}" if matchers else ""


def _quantile(metric: str, q: float = 0.95) -> Callable[[dict[str, str], str], str]:
    return lambda lab, rw: (
        f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{selector(lab)}[{rw}])))"
    )


def _ratio(num: str, den: str) -> Callable[[dict[str, str], str], str]:
    return lambda lab, rw: (
        f"sum(rate({num}{selector(lab)}[{rw}])) / sum(rate({den}{selector(lab)}[{rw}]))"
    )


@dataclass(frozen=True, slots=True)
class KeySeries:
    name: str
    query: Callable[[dict[str, str], str], str]  # (label filter, rate window) -> PromQL
    min_scale: float  # smallest move worth a z of 1, in the series' unit
    exemplar_metric: str | None = None  # histogram whose exemplars explain this series
    rel_floor: float = 0.01  # ... or this fraction of the reference level, if larger


KEY_SERIES: tuple[KeySeries, ...] = (
    KeySeries(
        "ttft_p95_seconds",
        _quantile("moeserve_time_to_first_token_seconds"),
        0.01,
        "moeserve_time_to_first_token_seconds_bucket",
    ),
    KeySeries(
        "tpot_p95_seconds",
        _quantile("moeserve_time_per_output_token_seconds"),
        0.002,
        "moeserve_time_per_output_token_seconds_bucket",
    ),
    KeySeries(
        "e2e_p95_seconds",
        _quantile("moeserve_e2e_request_latency_seconds"),
        0.05,
        "moeserve_e2e_request_latency_seconds_bucket",
    ),
    KeySeries(
        "queue_time_p95_seconds",
        _quantile("moeserve_request_queue_time_seconds"),
        0.01,
        "moeserve_time_to_first_token_seconds_bucket",
    ),
    KeySeries(
        "requests_waiting",
        lambda lab, rw: f"sum(moeserve_num_requests_waiting{selector(lab)})",
        0.5,
    ),
    KeySeries(
        "requests_running",
        lambda lab, rw: f"sum(moeserve_num_requests_running{selector(lab)})",
        0.5,
    ),
    KeySeries(
        "kv_cache_usage_ratio",
        lambda lab, rw: f"max(moeserve_kv_cache_usage_ratio{selector(lab)})",
        0.01,
    ),
    KeySeries(
        "preemptions_per_second",
        lambda lab, rw: f"sum(rate(moeserve_preemptions_total{selector(lab)}[{rw}]))",
        0.05,
    ),
    KeySeries(
        "error_ratio",
        lambda lab, rw: (
            f"sum(rate(moeserve_requests_total{selector(lab, status='server_error')}[{rw}]))"
            f" / sum(rate(moeserve_requests_total{selector(lab)}[{rw}]))"
        ),
        0.005,
        "moeserve_e2e_request_latency_seconds_bucket",
    ),
    KeySeries(
        "generation_tokens_per_second",
        lambda lab, rw: f"sum(rate(moeserve_generation_tokens_total{selector(lab)}[{rw}]))",
        1.0,
    ),
    KeySeries(
        "expert_imbalance",
        lambda lab, rw: f"max(moeserve_moe_expert_imbalance{selector(lab)})",
        0.05,
    ),
    # The drivers of causes.py: what moves first when a cause is at work. Their scales are
    # relative (10% of the reference level is a z of 1) where the level is workload-specific.
    KeySeries(
        # requests per second that wanted the engine: those it finished (aborts included)
        # and those refused for want of room (429); not the malformed ones validation refused
        "arrival_rate",
        lambda lab, rw: (
            f"sum(rate(moeserve_requests_total{selector(lab, raw=_REACHED_ENGINE)}[{rw}]))"
            f" + (sum(rate(moeserve_requests_total{selector(lab, status='rejected')}[{rw}]))"
            " or vector(0))"
        ),
        0.2,
        rel_floor=0.1,
    ),
    KeySeries(
        "prompt_tokens_per_request",
        _ratio("moeserve_prompt_tokens_total", "moeserve_e2e_request_latency_seconds_count"),
        1.0,
        "moeserve_time_to_first_token_seconds_bucket",
        rel_floor=0.1,
    ),
    KeySeries(
        "step_seconds_per_sequence",  # decode-only steps: the speed on unchanged work
        _quantile("moeserve_engine_decode_seconds_per_sequence", 0.5),
        0.0001,
        "moeserve_time_per_output_token_seconds_bucket",
        rel_floor=0.1,
    ),
    KeySeries(
        "spans_dropped_per_second",
        lambda lab, rw: f"sum(rate(moeserve_trace_spans_dropped_total{selector(lab)}[{rw}]))",
        0.02,  # none are dropped normally: the alert's 0.1 spans/s is already a z of 5
    ),
    KeySeries(
        "startup_seconds",  # the instance's last start (a restart that took longer moves it)
        lambda lab, rw: f"max(sum by (instance) (moeserve_startup_phase_seconds{selector(lab)}))",
        1.0,
        rel_floor=0.1,
    ),
    KeySeries(
        "cost_per_million_tokens",  # --cost-per-hour over the output tokens served
        lambda lab, rw: f"max(moeserve_cost_per_million_tokens{selector(lab, kind='output')})",
        0.001,
        rel_floor=0.1,
    ),
    KeySeries(
        "target_up",  # Prometheus's scrape health of the instance (`up` has no model label)
        lambda lab, rw: f"min(up{selector({k: v for k, v in lab.items() if k != 'model'})})",
        0.02,
    ),
)
EXEMPLAR_METRICS = (
    "moeserve_time_to_first_token_seconds_bucket",
    "moeserve_e2e_request_latency_seconds_bucket",
    "moeserve_time_per_output_token_seconds_bucket",
)


def replica_of(labels: dict[str, str]) -> str | None:
    """The moeserve replica an alert concerns: its `instance`, unless the alert names another
    service (service="moeserve-observability": a part of the monitoring stack)."""
    if labels.get("service", "moeserve") != "moeserve":
        return None
    return labels.get("instance") or None


def alert_fingerprint(alert: AlertmanagerAlert) -> str:
    if alert.fingerprint:
        return alert.fingerprint
    blob = json.dumps(alert.labels, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def _timestamp(alert: AlertmanagerAlert) -> float | None:
    return alert.startsAt.timestamp() if alert.startsAt.year > 1970 else None


@dataclass(slots=True)
class _Window:
    start: float
    end: float
    step: float
    onset: float

    @property
    def grid(self) -> np.ndarray:
        n = math.floor((self.end - self.start) / self.step + 1e-9) + 1
        return self.start + self.step * np.arange(n)


class Analyzer:
    def __init__(
        self,
        settings: WebhookSettings,
        prometheus: PrometheusAPI,
        *,
        clock: Callable[[], float] = time.time,
        series: tuple[KeySeries, ...] = KEY_SERIES,
    ) -> None:
        self.settings = settings
        self.prometheus = prometheus
        self.clock = clock
        self.series = series
        self._limit = asyncio.Semaphore(settings.query_concurrency)

    def window(self, alert: AlertmanagerAlert) -> _Window:
        s = self.settings
        now = self.clock()
        starts = _timestamp(alert)
        onset = (starts if starts is not None else now) - s.onset_lookback_s
        start = min(now - s.window_s, onset - s.window_s / 2)
        start = max(start, now - s.max_window_s)
        step = max(s.step_s, (now - start) / s.max_points)
        onset = min(onset, now - 2 * step)
        if onset <= start:
            onset = start + (now - start) / 2
        return _Window(start, now, step, onset)

    async def analyze(self, alert: AlertmanagerAlert, received_at: float) -> Incident:
        t0 = time.perf_counter()
        incident = Incident(
            id=uuid.uuid4().hex,
            received_at=received_at,
            alertname=alert.labels.get("alertname", ""),
            severity=alert.labels.get("severity", ""),
            status=alert.status,
            fingerprint=alert_fingerprint(alert),
            labels=dict(alert.labels),
            annotations=dict(alert.annotations),
            starts_at=_timestamp(alert),
            replica=replica_of(alert.labels),
        )
        try:
            await self._enrich(incident, alert)
        except PrometheusError as exc:
            incident.prometheus = "unavailable" if exc.unavailable else "error"
            incident.reason = f"prometheus {incident.prometheus}: {exc.reason}"
        incident.analysis_seconds = time.perf_counter() - t0
        return incident

    async def _query(self, query: str, w: _Window) -> list[RangeSeries]:
        async with self._limit:
            return await self.prometheus.query_range(query, w.start, w.end, w.step)

    async def _fetch(
        self, labels: dict[str, str], w: _Window
    ) -> tuple[list[str], list[list[RangeSeries] | PrometheusError]]:
        queries = [ks.query(labels, self.settings.rate_window) for ks in self.series]
        results = await asyncio.gather(
            *(self._query(q, w) for q in queries), return_exceptions=True
        )
        for r in results:  # anything but a PrometheusError is a bug: let it surface
            if isinstance(r, BaseException) and not isinstance(r, PrometheusError):
                raise r
        errors = [r for r in results if isinstance(r, PrometheusError)]
        if len(errors) == len(results):
            raise errors[0]
        return queries, results  # type: ignore[return-value]

    async def _enrich(self, incident: Incident, alert: AlertmanagerAlert) -> None:
        w = self.window(alert)
        incident.window_start, incident.window_end = w.start, w.end
        labels = {k: alert.labels[k] for k in FILTER_LABELS if alert.labels.get(k)}
        queries, results = await self._fetch(labels, w)
        if labels and not any(isinstance(r, list) and r for r in results):
            incident.reason = (
                f"no key series matched the alert's labels {labels}; analysed all series"
            )
            labels = {}
            queries, results = await self._fetch(labels, w)

        grid = w.grid
        matrix = np.full((grid.size, len(self.series)), np.nan)
        for j, r in enumerate(results):
            if isinstance(r, list) and r:
                idx = np.rint((r[0].timestamps - w.start) / w.step).astype(int)
                ok = (idx >= 0) & (idx < grid.size)
                matrix[idx[ok], j] = r[0].values[ok]
        n_ref = int(np.searchsorted(grid, w.onset, side="left"))
        threshold = self.settings.threshold

        scores: list[MetricScore] = []
        flags = np.zeros(grid.size, dtype=bool)
        usable: list[int] = []
        for j, ks in enumerate(self.series):
            score, point_flags = self._score_column(ks, matrix[:, j], n_ref, results[j], queries[j])
            if point_flags is not None:
                usable.append(j)
                flags[n_ref:] |= point_flags[n_ref:]
            scores.append(score)
        scores.sort(key=lambda m: m.score, reverse=True)
        incident.metrics = scores
        incident.top_metrics = [m.name for m in scores if m.score >= threshold][:5]
        incident.causes = rank_causes(scores, threshold)

        if self.settings.isolation_forest and len(usable) >= 2 and n_ref >= 10:
            sub = matrix[:, usable]
            if grid.size - n_ref > 0:
                mv, mv_threshold = await asyncio.to_thread(
                    IsolationForestScorer().score, sub, n_ref
                )
                incident.multivariate_score = float(np.max(mv[n_ref:]))
                flags[n_ref:] |= mv[n_ref:] >= mv_threshold

        hits = np.flatnonzero(flags)
        if hits.size:
            incident.anomaly_start = float(grid[hits[0]])
            incident.anomaly_end = float(grid[hits[-1]])
        else:
            incident.anomaly_start, incident.anomaly_end = w.onset, w.end
        incident.exemplars = await self._exemplars(
            labels, incident.anomaly_start - w.step, w.end, incident.top_metrics
        )

    def _score_column(
        self,
        ks: KeySeries,
        col: np.ndarray,
        n_ref: int,
        result: list[RangeSeries] | PrometheusError,
        query: str,
    ) -> tuple[MetricScore, np.ndarray | None]:
        """The series' score and, when it could be scored, its per-point flags."""
        base = {"name": ks.name, "query": query, "reference": None, "recent": None, "peak": None}
        if isinstance(result, PrometheusError):
            return MetricScore(**base, score=0.0, direction="flat", status="error"), None
        ref, recent = col[:n_ref], col[n_ref:]
        if not np.isfinite(col).any():
            return MetricScore(**base, score=0.0, direction="flat", status="no_data"), None
        if np.isfinite(ref).sum() < MIN_REFERENCE_POINTS or not np.isfinite(recent).any():
            missing = MetricScore(**base, score=0.0, direction="flat", status="insufficient_data")
            return missing, None
        det = RobustZDetector(
            DetectorConfig(
                threshold=self.settings.threshold, min_scale=ks.min_scale, rel_floor=ks.rel_floor
            )
        )
        s = det.score(col, n_ref)
        k = int(np.argmax(s.score[n_ref:]))
        top = float(s.score[n_ref + k])
        peak = recent[k] if math.isfinite(recent[k]) else float(np.nanmax(recent))
        if top < self.settings.threshold:
            direction = "flat"
        else:
            direction = "up" if s.signed[n_ref + k] > 0 else "down"
        score = MetricScore(
            name=ks.name,
            query=query,
            score=round(top, 3),
            direction=direction,
            reference=float(s.median),
            recent=float(np.nanmedian(recent)),
            peak=float(peak),
        )
        return score, s.flags(self.settings.threshold)

    async def _exemplars(
        self, labels: dict[str, str], start: float, end: float, top_metrics: list[str]
    ) -> list[Exemplar]:
        by_name = {ks.name: ks for ks in self.series}
        order = [by_name[n].exemplar_metric for n in top_metrics if n in by_name]
        metrics = list(dict.fromkeys([m for m in order if m] + list(EXEMPLAR_METRICS)))

        async def one(metric: str) -> list[Exemplar]:
            async with self._limit:
                samples = await self.prometheus.query_exemplars(
                    f"{metric}{selector(labels)}", start, end
                )
            out = []
            for smp in samples:
                trace_id = next((smp.labels[k] for k in TRACE_ID_KEYS if k in smp.labels), None)
                if trace_id and start <= smp.timestamp <= end:
                    out.append(
                        Exemplar(
                            trace_id=trace_id,
                            metric=metric.removesuffix("_bucket"),
                            value=smp.value,
                            timestamp=smp.timestamp,
                            span_id=smp.labels.get("span_id") or smp.labels.get("spanID"),
                        )
                    )
            # slowest first: they explain a latency alert best
            return sorted(out, key=lambda e: e.value, reverse=True)

        results = await asyncio.gather(*(one(m) for m in metrics), return_exceptions=True)
        picked: dict[str, Exemplar] = {}
        for r in results:
            if isinstance(r, PrometheusError):
                continue
            if isinstance(r, BaseException):
                raise r
            for ex in r:
                if len(picked) >= self.settings.max_exemplars:
                    break
                picked.setdefault(ex.trace_id, ex)
        return list(picked.values())
