"""Telemetry for moeserve: structured logging (`telemetry.logging`), OpenTelemetry tracing
(`telemetry.tracing`) and Prometheus metrics (`telemetry.metrics`).

A leaf package: it imports only the stdlib, OTel, structlog, prometheus_client (and
msgspec/httpx/numpy); never `service` or `inference`. Engine data (StepStats, RequestTimes) is
duck-typed.
"""
