"""The anomaly-detection webhook (telemetry.anomaly).

Fast tests drive the Litestar app with its TestClient and a fake Prometheus (httpx
MockTransport). One test runs a real Prometheus (Debian `prometheus` binary, exemplar
storage on) scraping an in-test exporter whose TTFT jumps; it skips, saying so, when the
binary is absent.
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import numpy as np
import pytest
from litestar.testing import TestClient

from bench.harness import ManagedProcess, free_port, prometheus_process, wait_until
from telemetry.anomaly import WebhookSettings, create_app
from telemetry.anomaly.analyzer import Analyzer, selector
from telemetry.anomaly.prometheus_api import PrometheusAPI
from telemetry.anomaly.schemas import AlertmanagerAlert

NOW = 1_700_000_000.0


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z")


def make_alert(
    alertname: str = "MoeserveKVCacheNearFull",
    *,
    status: str = "firing",
    starts: float = NOW - 120,
    fingerprint: str | None = None,
    **labels: str,
) -> dict:
    labels = {"alertname": alertname, "severity": "warning", "model": "demo", **labels}
    return {
        "status": status,
        "labels": labels,
        "annotations": {"summary": f"{alertname} fired"},
        "startsAt": iso(starts),
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else iso(starts + 60),
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint or secrets.token_hex(8),
    }


def make_payload(alerts: list[dict] | None = None, **overrides) -> dict:
    alerts = alerts if alerts is not None else [make_alert()]
    body = {
        "version": "4",
        "groupKey": '{}:{alertname="MoeserveKVCacheNearFull"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "anomaly-webhook",
        "groupLabels": {"alertname": "MoeserveKVCacheNearFull"},
        "commonLabels": {"alertname": "MoeserveKVCacheNearFull"},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": alerts,
    }
    body.update(overrides)
    return body


def drain(client: TestClient) -> None:
    """Wait (in the app's own event loop) until every queued alert is an incident."""
    client.blocking_portal.call(client.app.state["webhook"].drain)


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(prometheus_url=closed_port_url(), query_timeout_s=1.0, max_body_bytes=65536)
    with TestClient(app=app) as c:
        yield c


# --------------------------------------------------------------------- validation


BAD_PAYLOADS = {
    "not json": b"this is not json",
    "empty body": b"",
    "json array": b"[]",
    "wrong version": json.dumps(make_payload(version="3")).encode(),
    "version as int": json.dumps(make_payload(version=4)).encode(),
    "missing alerts": json.dumps(
        {k: v for k, v in make_payload().items() if k != "alerts"}
    ).encode(),
    "alerts not a list": json.dumps(make_payload(alerts="nope")).encode(),
    "label value not a string": json.dumps(
        make_payload([{**make_alert(), "labels": {"alertname": 1}}])
    ).encode(),
    "unknown alert status": json.dumps(
        make_payload([{**make_alert(), "status": "pending"}])
    ).encode(),
    "bad timestamp": json.dumps(make_payload([{**make_alert(), "startsAt": "yesterday"}])).encode(),
    "missing startsAt": json.dumps(
        make_payload([{k: v for k, v in make_alert().items() if k != "startsAt"}])
    ).encode(),
}


@pytest.mark.parametrize("name", list(BAD_PAYLOADS))
def test_malformed_payload_is_rejected_with_a_reason(client: TestClient, name: str):
    resp = client.post(
        "/alerts", content=BAD_PAYLOADS[name], headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["error"] == "invalid Alertmanager payload" and body["reason"]
    if name == "wrong version":
        assert "version" in body["reason"]
    assert client.get("/incidents").json()["incidents"] == []


def test_body_over_the_limit_is_413(client: TestClient):
    huge = json.dumps(make_payload(commonAnnotations={"x": "y" * 100_000})).encode()
    resp = client.post("/alerts", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    metrics = client.get("/metrics").text
    assert 'moeserve_anomaly_webhook_payloads_total{result="too_large"} 1.0' in metrics


# --------------------------------------------------------------------- receiving


def test_prometheus_unreachable_still_records_the_incident(client: TestClient):
    resp = client.post("/alerts", json=make_payload([make_alert(fingerprint="f00d")]))
    assert resp.status_code == 200 and resp.json()["queued"] == 1
    drain(client)
    (incident,) = client.get("/incidents").json()["incidents"]
    assert incident["alertname"] == "MoeserveKVCacheNearFull"
    assert incident["fingerprint"] == "f00d"
    assert incident["prometheus"] == "unavailable"
    assert "unreachable" in incident["reason"]
    assert incident["exemplars"] == [] and incident["top_metrics"] == []
    assert client.get(f"/incidents/{incident['id']}").json()["id"] == incident["id"]
    assert client.get("/incidents/nope").status_code == 404
    metrics = client.get("/metrics").text
    assert 'moeserve_anomaly_webhook_incidents_total{prometheus="unavailable"} 1.0' in metrics
    assert "python_gc_objects_collected_total" not in metrics  # own registry only
    assert client.get("/health").json() == {"status": "ok", "queue_depth": 0, "incidents": 1}


def test_floods_are_bounded_and_deduplicated():
    app = create_app(
        prometheus_url=closed_port_url(),
        query_timeout_s=1.0,
        max_alerts_per_payload=5,
        queue_size=3,
        max_incidents=4,
    )
    alerts = [make_alert(fingerprint=f"fp{i}", instance=f"i{i}") for i in range(50)]
    with TestClient(app=app) as c:
        first = c.post("/alerts", json=make_payload(alerts)).json()
        assert first == {
            "status": "accepted",
            "queued": 3,
            "dropped": 2,
            "over_cap": 45,
            "duplicate": 0,
            "resolved": 0,
        }
        drain(c)
        # Alertmanager re-sends the group: analysed alerts are duplicates, the ones
        # dropped on a full queue get their chance now.
        again = c.post("/alerts", json=make_payload(alerts[:5])).json()
        assert again["duplicate"] == 3 and again["queued"] == 2
        drain(c)
        incidents = c.get("/incidents").json()["incidents"]
        assert len(incidents) == 4  # bounded store keeps the newest
        assert {i["fingerprint"] for i in incidents} <= {f"fp{i}" for i in range(5)}
        # resolving marks the stored incident
        resolved = make_alert(status="resolved", fingerprint=incidents[0]["fingerprint"])
        assert (
            c.post("/alerts", json=make_payload([resolved], status="resolved")).json()["resolved"]
            == 1
        )
        assert c.get(f"/incidents/{incidents[0]['id']}").json()["status"] == "resolved"
        assert (
            c.get("/incidents", params={"limit": 2}).json()["incidents"][1]["id"]
            == incidents[1]["id"]
        )


def test_forwarding_retries_and_never_blocks():
    calls: list[dict] = []

    def downstream(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        return httpx.Response(503 if len(calls) == 1 else 200)

    app = create_app(
        prometheus_url=closed_port_url(),
        query_timeout_s=1.0,
        forward_url="http://downstream.test/hook",
        forward_backoff_s=0.01,
        forward_transport=httpx.MockTransport(downstream),
    )
    with TestClient(app=app) as c:
        c.post("/alerts", json=make_payload([make_alert(alertname="MoeserveHighErrorRatio")]))
        drain(c)
        c.blocking_portal.call(c.app.state["webhook"].forwarder.join)
        metrics = c.get("/metrics").text
    assert len(calls) == 2  # one 503, one retry
    assert calls[-1]["alertname"] == "MoeserveHighErrorRatio"
    assert calls[-1]["prometheus"] == "unavailable"
    assert 'moeserve_anomaly_webhook_forwarded_total{result="ok"} 1.0' in metrics


# --------------------------------------------------------------------- analysis


def fake_prometheus(anomalous: str, onset: float) -> httpx.MockTransport:
    """query_range: every key series is noise around a level, except ``anomalous``,
    which jumps at ``onset``. query_exemplars: slow exemplars after the onset."""
    rng = np.random.default_rng(7)

    def handler(request: httpx.Request) -> httpx.Response:
        q = {k: v[0] for k, v in parse_qs(request.url.query.decode()).items()}
        if request.url.path == "/api/v1/query_exemplars":
            start, end = float(q["start"]), float(q["end"])
            data = []
            if "time_to_first_token" in q["query"]:
                exemplars = [
                    {"labels": {"trace_id": f"{i:032x}"}, "value": str(2.0 + i), "timestamp": t}
                    for i, t in enumerate(np.arange(onset, end, 15.0))
                    if start <= t <= end
                ]
                exemplars.append(
                    {"labels": {"trace_id": "e" * 32}, "value": "0.01", "timestamp": onset - 600}
                )
                data.append({"seriesLabels": {"__name__": "x"}, "exemplars": exemplars})
            return httpx.Response(200, json={"status": "success", "data": data})
        start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
        ts = np.arange(start, end + 1e-6, step)
        level = 10.0 + 10 * abs(hash(q["query"])) % 7
        values = level + rng.normal(0, 0.05 * level, ts.size)
        if anomalous in q["query"]:
            values[ts >= onset] += 0.6 * level
        if "preemptions" in q["query"]:
            return httpx.Response(
                200, json={"status": "success", "data": {"resultType": "matrix", "result": []}}
            )
        result = [
            {"metric": {}, "values": [[float(t), repr(float(v))] for t, v in zip(ts, values)]}
        ]
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "matrix", "result": result}}
        )

    return httpx.MockTransport(handler)


async def test_analyzer_ranks_the_moved_series_first_and_attaches_exemplars():
    onset = NOW - 200
    settings = WebhookSettings(prometheus_url="http://prom.test")
    prom = PrometheusAPI("http://prom.test", transport=fake_prometheus("kv_cache_usage", onset))
    analyzer = Analyzer(settings, prom, clock=lambda: NOW)
    alert = AlertmanagerAlert(
        status="firing",
        labels={"alertname": "MoeserveKVCacheNearFull", "model": "demo", "instance": "m:8000"},
        startsAt=datetime.fromtimestamp(onset + 60, tz=UTC),
    )
    incident = await analyzer.analyze(alert, NOW)
    await prom.aclose()
    assert incident.prometheus == "ok", incident.reason
    assert incident.top_metrics[0] == "kv_cache_usage_ratio"
    top = incident.metrics[0]
    assert top.direction == "up" and top.recent > top.reference
    assert {m.name: m.status for m in incident.metrics}["preemptions_per_second"] == "no_data"
    assert incident.window_end == NOW and incident.window_start <= NOW - settings.window_s
    assert onset - settings.step_s <= incident.anomaly_start <= onset + 2 * settings.step_s
    assert incident.multivariate_score is not None
    traces = [e.trace_id for e in incident.exemplars]
    assert traces and "e" * 32 not in traces  # only exemplars from the anomaly window
    assert incident.exemplars[0].value >= incident.exemplars[-1].value
    assert len(traces) <= settings.max_exemplars
    assert 'instance="m:8000"' in top.query and 'model="demo"' in top.query


def test_selector_escapes_label_values():
    assert selector({"model": 'a"b\\c'}, status="x") == '{model="a\\"b\\\\c",status="x"}'
    assert selector({}) == ""


# --------------------------------------------------------------------- live Prometheus


class Exporter:
    """prometheus_client metrics named like the service's, served as OpenMetrics (with
    exemplars). Every scrape first records one tick of synthetic traffic; ``anomaly``
    makes TTFT jump and tags those observations with fresh trace ids."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        lat = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
        lab = ["model", "api"]
        self.ttft = Histogram(
            "moeserve_time_to_first_token_seconds", "", lab, buckets=lat, registry=r
        )
        self.tpot = Histogram(
            "moeserve_time_per_output_token_seconds", "", lab, buckets=lat, registry=r
        )
        self.e2e = Histogram(
            "moeserve_e2e_request_latency_seconds", "", lab, buckets=lat, registry=r
        )
        self.queue = Histogram(
            "moeserve_request_queue_time_seconds", "", lab, buckets=lat, registry=r
        )
        self.tokens = Counter("moeserve_generation_tokens", "", lab, registry=r)
        self.requests = Counter(
            "moeserve_requests", "", lab + ["status", "finish_reason"], registry=r
        )
        self.preempt = Counter("moeserve_preemptions", "", ["model"], registry=r)
        self.waiting = Gauge("moeserve_num_requests_waiting", "", ["model"], registry=r)
        self.running = Gauge("moeserve_num_requests_running", "", ["model"], registry=r)
        self.kv = Gauge("moeserve_kv_cache_usage_ratio", "", ["model"], registry=r)
        self.imbalance = Gauge("moeserve_moe_expert_imbalance", "", ["model", "layer"], registry=r)
        self.anomaly = False
        self.normal_traces: set[str] = set()
        self.anomalous_traces: set[str] = set()
        self.rng = np.random.default_rng(3)
        self.lock = threading.Lock()

    def tick(self) -> None:
        rng, m = self.rng, {"model": "demo", "api": "rest"}
        for _ in range(5):
            trace = secrets.token_hex(16)
            if self.anomaly:
                self.anomalous_traces.add(trace)
                ttft = rng.uniform(1.5, 3.0)
            else:
                self.normal_traces.add(trace)
                ttft = rng.uniform(0.02, 0.06)
            self.ttft.labels(**m).observe(ttft, exemplar={"trace_id": trace})
            self.e2e.labels(**m).observe(rng.uniform(3.0, 3.5), exemplar={"trace_id": trace})
            self.tpot.labels(**m).observe(rng.uniform(0.02, 0.03), exemplar={"trace_id": trace})
            self.queue.labels(**m).observe(rng.uniform(0.001, 0.004))
            self.requests.labels(status="ok", finish_reason="stop", **m).inc()
        self.requests.labels(status="server_error", finish_reason="error", **m).inc(0)
        self.tokens.labels(**m).inc(float(rng.integers(45, 55)))
        self.preempt.labels(model="demo").inc(0)
        self.waiting.labels(model="demo").set(float(rng.integers(0, 3)))
        self.running.labels(model="demo").set(float(rng.integers(3, 6)))
        self.kv.labels(model="demo").set(0.3 + rng.normal(0, 0.01))
        self.imbalance.labels(model="demo", layer="0").set(1.2 + rng.normal(0, 0.02))

    def serve(self) -> ThreadingHTTPServer:
        from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST, generate_latest

        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with exporter.lock:
                    exporter.tick()
                    body = generate_latest(exporter.registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.fixture
def exporter() -> Iterator[tuple[Exporter, int]]:
    exp = Exporter()
    server = exp.serve()
    try:
        yield exp, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def start_prometheus(tmp_path: Path, target_port: int) -> tuple[ManagedProcess, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "prometheus binary not installed (apt-get install prometheus); live test not run"
        )
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 400ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: moeserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    proc = prometheus_process(binary, config, tmp_path, port)
    return proc.start(), f"http://127.0.0.1:{port}"


def scraped_points(url: str) -> int:
    try:
        r = httpx.get(
            f"{url}/api/v1/query",
            params={"query": "count_over_time(moeserve_kv_cache_usage_ratio[1m])"},
        )
        result = r.json()["data"]["result"]
        return int(float(result[0]["value"][1])) if result else 0
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def test_live_prometheus_ranks_the_injected_metric_and_carries_exemplars(exporter, tmp_path):
    exp, target_port = exporter
    proc, url = start_prometheus(tmp_path, target_port)
    try:
        wait_until(lambda: scraped_points(url) >= 16, 30, "8 s of baseline scrapes")
        with exp.lock:
            exp.anomaly = True
            flipped = time.time()
        wait_until(
            lambda: time.time() - flipped > 4.0 and scraped_points(url) >= 24, 15, "anomaly scrapes"
        )
        app = create_app(
            prometheus_url=url,
            window_s=30,
            step_s=0.5,
            rate_window="2s",
            onset_lookback_s=1.0,
        )
        alert = make_alert(
            "MoeserveTTFTSLOBurnRate",
            starts=flipped,
            severity="critical",
            job="moeserve",
            instance=f"127.0.0.1:{target_port}",
        )
        with TestClient(app=app) as c:
            assert c.post("/alerts", json=make_payload([alert])).json()["queued"] == 1
            drain(c)
            (incident,) = c.get("/incidents").json()["incidents"]
    finally:
        proc.stop()
    assert incident["prometheus"] == "ok", incident["reason"]
    print(
        "\nlive incident:",
        json.dumps({k: incident[k] for k in ("top_metrics", "multivariate_score")}),
    )
    print(
        "scores:",
        {
            m["name"]: (m["score"], m["reference"], m["recent"], m["peak"])
            for m in incident["metrics"]
        },
    )
    assert incident["top_metrics"][0] == "ttft_p95_seconds"
    top = incident["metrics"][0]
    assert top["direction"] == "up" and top["recent"] > 1.0 > top["reference"]
    assert incident["anomaly_start"] >= flipped - 2.0
    traces = [e["trace_id"] for e in incident["exemplars"]]
    assert traces, "no exemplar trace ids"
    assert traces[0] in exp.anomalous_traces
    slow = [
        e
        for e in incident["exemplars"]
        if e["metric"] == "moeserve_time_to_first_token_seconds" and e["value"] > 1.0
    ]
    assert slow and all(e["trace_id"] in exp.anomalous_traces for e in slow)
    assert not math.isnan(incident["metrics"][0]["score"])


# --------------------------------------------------------------------- replicas


def test_incidents_name_the_replica_an_alert_concerns():
    """An alert about one replica (its `instance`) names it in the incident, the forwarded
    incident and the log line; one about the monitoring stack names none."""
    forwarded: list[dict] = []

    def downstream(request: httpx.Request) -> httpx.Response:
        forwarded.append(json.loads(request.content))
        return httpx.Response(200)

    app = create_app(
        prometheus_url=closed_port_url(),
        query_timeout_s=1.0,
        forward_url="http://downstream.test/hook",
        forward_transport=httpx.MockTransport(downstream),
    )
    down = make_alert(
        "MoeserveReplicaDown",
        service="moeserve",
        instance="replica-2:8000",
        worker="http://replica-2:8000",
    )
    starved = make_alert("MoeserveReplicaStarved", service="moeserve", instance="replica-3:8000")
    stack = make_alert(
        "ScrapeTargetDown", service="moeserve-observability", instance="alertmanager:9093"
    )
    with TestClient(app=app) as c:
        assert c.post("/alerts", json=make_payload([down, starved, stack])).status_code == 200
        drain(c)
        c.blocking_portal.call(c.app.state["webhook"].forwarder.join)
        incidents = {i["alertname"]: i for i in c.get("/incidents").json()["incidents"]}
    assert incidents["MoeserveReplicaDown"]["replica"] == "replica-2:8000"
    assert incidents["MoeserveReplicaStarved"]["replica"] == "replica-3:8000"
    assert incidents["ScrapeTargetDown"]["replica"] is None
    assert {f["alertname"]: f["replica"] for f in forwarded} == {
        "MoeserveReplicaDown": "replica-2:8000",
        "MoeserveReplicaStarved": "replica-3:8000",
        "ScrapeTargetDown": None,
    }


async def test_a_replica_alert_is_analysed_on_that_replicas_series():
    """MoeserveReplicaDown carries no job (the router's is dropped): its analysis selects the
    replica's own series by instance, and the incident names the replica."""
    onset = NOW - 200
    settings = WebhookSettings(prometheus_url="http://prom.test")
    prom = PrometheusAPI(
        "http://prom.test", transport=fake_prometheus("num_requests_waiting", onset)
    )
    analyzer = Analyzer(settings, prom, clock=lambda: NOW)
    labels = {
        "alertname": "MoeserveReplicaDown",
        "service": "moeserve",
        "severity": "critical",
        "instance": "replica-2:8000",
        "worker": "http://replica-2:8000",
    }
    alert = AlertmanagerAlert(
        status="firing", labels=labels, startsAt=datetime.fromtimestamp(onset + 60, tz=UTC)
    )
    incident = await analyzer.analyze(alert, NOW)
    await prom.aclose()
    assert incident.replica == "replica-2:8000" and incident.prometheus == "ok"
    for metric in incident.metrics:
        assert 'instance="replica-2:8000"' in metric.query and "job=" not in metric.query
