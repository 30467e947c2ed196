"""A real Alertmanager (Debian `prometheus-alertmanager`), configured from
deploy/alertmanager/alertmanager.yml with the webhook URL pointed at a webhook served
by uvicorn on a free loopback port, delivers alerts posted to its API; the shipped
inhibition rules hold back what they should. Skips, saying so, without the binary."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import uvicorn

from bench.harness import free_port, wait_for_http, wait_until
from bench.scenarios.stack import alertmanager_config, alertmanager_process
from telemetry.anomaly import create_app


@pytest.fixture
def webhook_url() -> Iterator[str]:
    port = free_port()
    app = create_app(prometheus_url=f"http://127.0.0.1:{free_port()}", query_timeout_s=1.0)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def alertmanager(tmp_path: Path, webhook_url: str) -> Iterator[str]:
    """The shipped config, receivers pointed at `webhook_url`, 1 s group timers, fresh
    storage, no clustering (bench/scenarios/stack.py builds it for the fault scenarios too)."""
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        pytest.skip(
            "alertmanager not installed (apt-get install prometheus-alertmanager); test not run"
        )
    config = alertmanager_config(tmp_path, webhook_url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with alertmanager_process(binary, config, tmp_path, port) as proc:
        wait_for_http(f"{url}/-/ready", 20, process=proc)
        yield url


def post_alerts(am_url: str, *label_sets: dict[str, str]) -> None:
    now = datetime.now(UTC).isoformat()
    body = [
        {"labels": labels, "annotations": {"summary": "test"}, "startsAt": now}
        for labels in label_sets
    ]
    resp = httpx.post(f"{am_url}/api/v2/alerts", json=body, timeout=5)
    assert resp.status_code == 200, resp.text


def incidents(webhook_url: str) -> list[dict]:
    return httpx.get(f"{webhook_url}/incidents", timeout=5).json()["incidents"]


def test_alertmanager_delivers_to_the_webhook_with_inhibitions(alertmanager, webhook_url):
    inst = {"job": "moeserve", "instance": "moeserve:8000"}
    other = {"job": "moeserve", "instance": "other:8000", "model": "m2"}
    post_alerts(
        alertmanager,
        # target down inhibits the same instance's capacity alert...
        {"alertname": "MoeserveTargetDown", "severity": "critical", **inst},
        {"alertname": "MoeserveKVCacheNearFull", "severity": "warning", "model": "demo", **inst},
        # ...and a critical alert inhibits its warning twin.
        {"alertname": "MoeserveHighErrorRatio", "severity": "critical", **other},
        {"alertname": "MoeserveHighErrorRatio", "severity": "warning", **other},
    )
    got = wait_until(
        lambda: len(incidents(webhook_url)) >= 2 and incidents(webhook_url), 20, "2 incidents"
    )
    # a later, uninhibited alert: once it is in, the earlier groups have flushed too
    control = {"alertname": "MoeserveExpertLoadImbalance", "severity": "warning", "layer": "1"}
    post_alerts(alertmanager, {**control, **other})
    got = wait_until(
        lambda: (
            any(i["alertname"] == "MoeserveExpertLoadImbalance" for i in incidents(webhook_url))
            and incidents(webhook_url)
        ),
        20,
        "the control alert",
    )
    seen = {(i["alertname"], i["severity"]) for i in got}
    assert seen == {
        ("MoeserveTargetDown", "critical"),
        ("MoeserveHighErrorRatio", "critical"),
        ("MoeserveExpertLoadImbalance", "warning"),
    }
    for incident in got:
        assert incident["prometheus"] == "unavailable" and incident["reason"]
        assert incident["fingerprint"]  # Alertmanager's own fingerprint
