"""The webhook's own Prometheus metrics, in a private CollectorRegistry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "moeserve_anomaly_webhook_"
        self.payloads = Counter(
            p + "payloads", "Webhook payloads received, by outcome",
            ["result"], registry=r,
        )  # fmt: skip
        self.alerts = Counter(
            p + "alerts", "Alerts received, by alert status and handling",
            ["status", "handling"], registry=r,
        )  # fmt: skip
        self.incidents = Counter(
            p + "incidents", "Incidents recorded, by Prometheus availability",
            ["prometheus"], registry=r,
        )  # fmt: skip
        self.analysis_seconds = Histogram(
            p + "analysis_seconds", "Time to analyse one alert",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )  # fmt: skip
        self.forwarded = Counter(
            p + "forwarded", "Incidents forwarded to the downstream webhook, by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(p + "queue_depth", "Alerts waiting for analysis", registry=r)
        self.stored = Gauge(p + "incidents_stored", "Incidents kept in memory", registry=r)
        for result in ("accepted", "invalid", "too_large"):
            self.payloads.labels(result=result)
        for prom in ("ok", "unavailable", "error"):
            self.incidents.labels(prometheus=prom)
        for result in ("ok", "failed", "dropped"):
            self.forwarded.labels(result=result)
