"""Entry point of `moeserve anomaly-webhook`: serve the webhook app with uvicorn."""

from __future__ import annotations

from typing import Any

from .app import create_app
from .config import WebhookSettings


def run(
    host: str = "127.0.0.1",
    port: int = 9095,
    prometheus_url: str = "http://127.0.0.1:9090",
    forward_url: str | None = None,
    **settings: Any,
) -> None:
    """Serve until interrupted. ``settings`` are further WebhookSettings fields
    (window_s, step_s, max_body_bytes, ...). Logging is configured by the caller;
    uvicorn's own logging configuration is left alone."""
    import uvicorn

    app = create_app(
        WebhookSettings(prometheus_url=prometheus_url, forward_url=forward_url, **settings)
    )
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False)
