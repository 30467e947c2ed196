"""Settings of the anomaly-detection webhook (one frozen dataclass, passed down once)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    prometheus_url: str = "http://127.0.0.1:9090"
    forward_url: str | None = None
    # analysis window
    window_s: float = 1800.0  # history pulled per alert (30 min)
    step_s: float = 15.0  # query_range resolution
    rate_window: str = "1m"  # range of the rate() calls in the key-series queries
    onset_lookback_s: float = 300.0  # the anomaly may start this long before startsAt
    max_window_s: float = 6 * 3600.0  # never query more than this
    max_points: int = 1000  # step grows to keep each series under this
    query_timeout_s: float = 5.0
    query_concurrency: int = 8
    # receiver bounds
    max_body_bytes: int = 1 << 20
    max_alerts_per_payload: int = 20
    dedupe_s: float = 300.0
    max_incidents: int = 500
    queue_size: int = 256
    workers: int = 2
    max_exemplars: int = 10
    # detector
    threshold: float = 4.0
    isolation_forest: bool = True
    # forwarding of enriched incidents
    forward_timeout_s: float = 5.0
    forward_retries: int = 3
    forward_backoff_s: float = 0.5
    forward_queue_size: int = 100

    def __post_init__(self) -> None:
        assert self.window_s > 0 and self.step_s > 0 and self.max_points >= 10
        assert self.max_body_bytes > 0 and self.max_alerts_per_payload > 0
        assert self.queue_size > 0 and self.workers > 0 and self.max_incidents > 0
        assert self.forward_retries >= 0 and self.forward_queue_size > 0
