"""Anomaly-detection webhook (`moeserve anomaly-webhook`).

Receives Alertmanager notifications, pulls the service's key series around each firing
alert from Prometheus, scores them (robust z-score / EWMA chart per series, an
IsolationForest across series), ranks what moved, attaches exemplar trace ids, logs and
keeps the incident, and optionally forwards it. Part of the telemetry leaf package:
never imports `service` or `inference`.
"""

from .app import create_app
from .config import WebhookSettings
from .server import run

__all__ = ["WebhookSettings", "create_app", "run"]
