"""Wire types: the Alertmanager webhook payload (version 4) and the enriched incident."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec


class AlertmanagerAlert(msgspec.Struct, kw_only=True):
    """One alert of an Alertmanager webhook notification."""

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: datetime
    endsAt: datetime | None = None
    generatorURL: str = ""
    fingerprint: str = ""


class AlertmanagerPayload(msgspec.Struct, kw_only=True):
    """Alertmanager webhook payload, version "4" (the only version Alertmanager sends)."""

    version: Literal["4"]
    groupKey: str
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: str
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    externalURL: str = ""
    alerts: list[AlertmanagerAlert]


class MetricScore(msgspec.Struct, kw_only=True):
    """How much one key series moved in the anomaly window against its reference."""

    name: str
    score: float  # max robust z in the recent window (0 when no data)
    direction: Literal["up", "down", "flat"]
    reference: float | None  # median before the onset
    recent: float | None  # median after the onset
    peak: float | None  # the recent value furthest from the reference
    status: Literal["ok", "no_data", "insufficient_data", "error"] = "ok"
    query: str = ""


class CauseScore(msgspec.Struct, kw_only=True):
    """A cause the analysis implicates (telemetry/anomaly/causes.py), with its evidence."""

    cause: str  # queue | prefill | step_time | kv_cache | trace_export | engine | ...
    score: float  # the strongest move of its evidence series (robust z)
    summary: str
    evidence: list[str]  # the key series that moved, strongest first
    inferred: bool = False  # named from consequences only: no driver of any cause moved


class Exemplar(msgspec.Struct, kw_only=True):
    trace_id: str
    metric: str
    value: float
    timestamp: float
    span_id: str | None = None


class Incident(msgspec.Struct, kw_only=True):
    """An alert enriched with what moved and which traces to look at."""

    id: str
    received_at: float
    alertname: str
    severity: str
    status: Literal["firing", "resolved"]
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float | None
    replica: str | None = None  # the moeserve replica (its `instance`) the alert concerns
    window_start: float | None = None
    window_end: float | None = None
    anomaly_start: float | None = None
    anomaly_end: float | None = None
    top_metrics: list[str] = []
    causes: list[CauseScore] = []  # best first: what changed, not only what hurts
    metrics: list[MetricScore] = []
    multivariate_score: float | None = None
    exemplars: list[Exemplar] = []
    prometheus: Literal["ok", "unavailable", "error"] = "ok"
    reason: str | None = None
    resolved_at: float | None = None
    analysis_seconds: float = 0.0
