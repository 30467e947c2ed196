"""End to end on loopback, everything real: `moeserve serve` (tiny model, an 8-deep
waiting queue) scraped every second by Debian's `prometheus` (exemplar storage on,
the shipped rule files with the targeted alert's `for:` shortened), which sends to
Debian's `prometheus-alertmanager` (the shipped config, receiver pointed at the test
webhook, short timers, fresh storage, no clustering), which delivers to the anomaly
webhook. A phase of steady traffic that keeps the engine's running slots busy with an empty
queue, then a flood of the same streaming requests that keeps the waiting queue full (and
gets 429s): MoeserveWaitingQueueSaturated fires, and
GET /incidents on the webhook shows an incident that ranks arrivals / queue time / TTFT first,
names the queue as the cause, and
scores the waiting-queue series as anomalous and carries trace ids the service exported as exemplars.
Skips, saying so, when a binary is missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import test_anomaly_alertmanager as am_test
import uvicorn
import yaml
from test_anomaly_alertmanager import incidents

from bench.harness import (
    ServerProcess,
    free_port,
    prometheus_process,
    wait_for_http,
    wait_until,
)
from telemetry.anomaly import create_app
from telemetry.anomaly.config import WebhookSettings

pytestmark = pytest.mark.slow

# The Alertmanager fixture of test_anomaly_alertmanager (shipped config, receiver URL
# rewritten, 1 s group timers, fresh --storage.path, --cluster.listen-address=), reused:
# the webhook_url it depends on resolves to this module's fixture below.
alertmanager = am_test.alertmanager

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERT = "MoeserveWaitingQueueSaturated"
SEVERITY = "critical"
FOR = "3s"  # the shipped rule says 1m
MODEL = "demo"
MAX_WAITING, MAX_NUM_SEQS = 8, 2
NORMAL_S = 18.0  # steady traffic before the flood: the detector's reference stretch
# Steady clients, one per running slot, each back as soon as its request ends: the engine
# generates as fast before the flood as during it, so what the flood moves is the queue (with
# a single client a fast CPU's engine idled between its requests, and the flood's tokens/s
# outranked the queue's series)
STEADY_CLIENTS = MAX_NUM_SEQS
FLOOD_CLIENTS = 14  # > MAX_WAITING + MAX_NUM_SEQS: the queue stays full, the rest get 429
DETECTOR_THRESHOLD = WebhookSettings().threshold
# What a full queue moves first: the queue itself, and the latencies that contain its wait
QUEUE_SERIES = (
    "queue_time_p95_seconds",
    "requests_waiting",
    "arrival_rate",
    "ttft_p95_seconds",
    "e2e_p95_seconds",
)
# Same requests before and during the flood: only the concurrency turns pathological. The
# critical rule needs the queue at 8 of 8 at each evaluation for FOR, and each finished request
# leaves it at 7 until its client's next one arrives: with 32 tokens a fast CPU (AMD EPYC,
# tiny model) showed 8 in 75% of samples (the rule then waited past 60 s once in three
# runs), with 64 in 87%; still short enough that queued flood requests reach their first token
# well before the webhook's analysis.
REQUEST = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "stream": True}
TRACE_ID = re.compile(r'trace_id="([0-9a-f]{32})"')
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


# --- configuration derived from the shipped files --------------------------------------


def short_alert_rules(path: Path, alert: str, severity: str, for_: str) -> dict:
    """The shipped alert rules with `for:` of (alert, severity) shortened; the rule's
    expression (and every other rule) is kept as shipped."""
    doc = yaml.safe_load(path.read_text())
    hits = [
        rule
        for group in doc["groups"]
        for rule in group["rules"]
        if rule.get("alert") == alert and rule.get("labels", {}).get("severity") == severity
    ]
    assert len(hits) == 1, f"expected one {alert}/{severity} rule in {path}, found {len(hits)}"
    hits[0]["for"] = for_
    return doc


def prometheus_config(tmp: Path, target: str, alertmanager_url: str) -> Path:
    """deploy/prometheus/prometheus.yml with 1 s scrapes and rule evaluation, the
    moeserve job pointed at `target`, alerts sent to `alertmanager_url`, and the rule
    files copied (the targeted alert's `for:` shortened)."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    rule_files = []
    for rel in cfg["rule_files"]:
        src = PROMETHEUS_YML.parent / rel
        dst = tmp / src.name
        if src.name == "moeserve-alerts.rules.yml":
            doc = short_alert_rules(src, ALERT, SEVERITY, FOR)
            dst.write_text(yaml.safe_dump(doc, sort_keys=False))
        else:
            shutil.copyfile(src, dst)
        rule_files.append(str(dst))
    cfg["rule_files"] = rule_files
    (am,) = cfg["alerting"]["alertmanagers"]
    am["static_configs"] = [{"targets": [alertmanager_url.removeprefix("http://")]}]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "moeserve"]
    job.update(scrape_interval="1s", scrape_timeout="1s", static_configs=[{"targets": [target]}])
    cfg["scrape_configs"] = [job]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# --- processes ----------------------------------------------------------------------


def _binary(*names: str, package: str) -> str:
    for name in names:
        if found := shutil.which(name):
            return found
    pytest.skip(f"{names[0]} not installed (apt-get install {package}); end-to-end test not run")


def finished_trace_ids(service: ServerProcess) -> set[str]:
    return {
        r["trace_id"]
        for r in service.records
        if r.get("event") == "request finished" and r.get("trace_id")
    }


@pytest.fixture
def binaries() -> None:
    """Skip before anything starts when a binary is missing."""
    _binary("prometheus", package="prometheus")
    _binary("prometheus-alertmanager", "alertmanager", package="prometheus-alertmanager")


@pytest.fixture
def service(binaries: None, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """Started on a port chosen here, not waited for: the other processes start meanwhile."""
    server = ServerProcess(
        tiny_model_dir,
        "--device", "cpu", "--dtype", "float32", "--max-waiting", MAX_WAITING,
        "--max-num-seqs", MAX_NUM_SEQS, "--drain-timeout", "2", "--served-model-name", MODEL,
        port=free_port(),
        env={"OTEL_TRACES_EXPORTER": "none"},  # trace ids are still made (and land in exemplars)
        stop_timeout=15,
    )  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prometheus_port() -> int:
    return free_port()


@pytest.fixture
def webhook_url(prometheus_port: int) -> Iterator[str]:
    """The anomaly webhook in-process, querying the test Prometheus, with an analysis
    window sized for a test that lasts a minute (1 s steps)."""
    port = free_port()
    app = create_app(
        prometheus_url=f"http://127.0.0.1:{prometheus_port}",
        window_s=120.0,
        step_s=1.0,
        onset_lookback_s=15.0,  # the alert fires `for:` + a scrape or two after the onset
        query_timeout_s=10.0,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 15, "the webhook to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def prometheus(
    tmp_path: Path, service: ServerProcess, alertmanager: str, prometheus_port: int
) -> Iterator[str]:
    binary = _binary("prometheus", package="prometheus")
    config = prometheus_config(tmp_path, f"127.0.0.1:{service.rest_port}", alertmanager)
    if promtool := shutil.which("promtool"):
        check = subprocess.run(
            [promtool, "check", "config", str(config)], check=False, capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
    url = f"http://127.0.0.1:{prometheus_port}"
    with prometheus_process(binary, config, tmp_path, prometheus_port, stop_timeout=15) as proc:
        wait_for_http(f"{url}/-/ready", 30, process=proc)
        yield url


# --- load ---------------------------------------------------------------------------


class Load:
    """Client threads against the service: light traffic, then a flood."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.flood = threading.Event()
        self.counts: dict[str, int] = {"ok": 0, "429": 0, "other": 0}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _light(self, i: int) -> None:
        body = {**REQUEST, "prompt": f"light traffic {i}: tell me a story"}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set() and not self.flood.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                        self._count("ok" if r.status_code == 200 else "other")
                except httpx.HTTPError:
                    self._count("other")

    def _flooder(self, i: int) -> None:
        body = {**REQUEST, "prompt": f"flood {i}: tell me a story"}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code == 429:
                            self._count("429")
                            self.stop.wait(0.05)  # come straight back: keep the queue full
                            continue
                        for _ in r.iter_lines():
                            if self.stop.is_set():
                                break  # disconnect: the server aborts the request
                        self._count("ok" if r.status_code == 200 else "other")
                except httpx.HTTPError:
                    self._count("other")

    def _start(self, target, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=target, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def start_light(self) -> None:
        self._start(self._light, STEADY_CLIENTS)

    def start_flood(self) -> None:
        self.flood.set()
        self._start(self._flooder, FLOOD_CLIENTS)

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=15)


class ExemplarScraper:
    """Scrapes the service's /metrics as OpenMetrics and keeps every exemplar trace id."""

    def __init__(self, url: str, period_s: float = 0.3) -> None:
        self.url, self.period_s = url, period_s
        self.trace_ids: set[str] = set()
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                try:
                    r = client.get(f"{self.url}/metrics", headers={"Accept": OPENMETRICS})
                    self.trace_ids.update(TRACE_ID.findall(r.text))
                except httpx.HTTPError:
                    pass
                self.stop.wait(self.period_s)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=15)


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def prometheus_exemplar_trace_ids(prom: str, start: float, end: float) -> set[str]:
    r = httpx.get(
        f"{prom}/api/v1/query_exemplars",
        params={"query": '{__name__=~"moeserve_.+", job="moeserve"}', "start": start, "end": end},
        timeout=10,
    )
    r.raise_for_status()
    return {
        ex["labels"]["trace_id"]
        for series in r.json()["data"]
        for ex in series["exemplars"]
        if "trace_id" in ex["labels"]
    }


# --- the test -----------------------------------------------------------------------


def test_queue_flood_fires_an_alert_that_reaches_the_webhook_as_an_incident(
    service: ServerProcess, prometheus: str, alertmanager: str, webhook_url: str
) -> None:
    t0 = time.time()
    service.wait_ready(timeout=120)
    wait_until(
        lambda: query(prometheus, 'up{job="moeserve"} == 1'), 20, "the first scrape of moeserve"
    )
    rules = httpx.get(f"{prometheus}/api/v1/rules", params={"type": "alert"}, timeout=10).json()
    loaded = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
    assert ALERT in loaded, loaded

    load = Load(service.url)
    scraper = ExemplarScraper(service.url)
    try:
        load.start_light()
        time.sleep(NORMAL_S)
        assert load.counts["ok"] >= 3, load.counts
        assert not query(prometheus, f'ALERTS{{alertname="{ALERT}"}}'), "fired before the flood"
        flood_at = time.time()
        load.start_flood()

        def the_incident() -> dict | None:
            for incident in incidents(webhook_url):
                if incident["alertname"] == ALERT and incident["status"] == "firing":
                    return incident
            return None

        incident = wait_until(the_incident, 60, f"an {ALERT} incident at the webhook")
        detected_at = time.time()
        # Prometheus fired it during the flood (a range query: on a busy machine the queue
        # may already have drained by the time the webhook finished its analysis)
        firing = query(
            prometheus, f'max_over_time(ALERTS{{alertname="{ALERT}", alertstate="firing"}}[5m])'
        )
        assert [a["metric"]["severity"] for a in firing] == [SEVERITY], firing
        # Alertmanager is the only sender of alerts to the webhook in this test, so the
        # incident itself is the proof of delivery; its fingerprint is Alertmanager's
        assert len(incident["fingerprint"]) == 16, incident
    finally:
        load.close()
        scraper.close()

    # What fired, as Prometheus saw it, and what it sent.
    assert incident["severity"] == SEVERITY
    labels = incident["labels"]
    assert labels["job"] == "moeserve" and labels["instance"] == f"127.0.0.1:{service.rest_port}"
    assert labels["model"] == MODEL and labels["service"] == "moeserve"
    assert incident["fingerprint"] and incident["annotations"]["runbook_url"].endswith(
        "#moeservewaitingqueuesaturated"
    )
    assert incident["starts_at"] >= flood_at - 1, (incident["starts_at"], flood_at)
    assert load.counts["429"] > 0, load.counts  # the queue was really full

    # The analysis: Prometheus answered, the waiting queue is ranked among what moved.
    assert incident["prometheus"] == "ok", incident.get("reason")
    scores = {m["name"]: m for m in incident["metrics"]}
    waiting = scores["requests_waiting"]
    ranking = [(m["name"], m["score"], m["direction"]) for m in incident["metrics"]]
    # A full queue shows as queueing: arrivals / queue time / waiting requests and the
    # latencies that contain the wait (TTFT, e2e) lead, and the cause named first is the
    # queue (more arrivals than the server completes)...
    assert set(incident["top_metrics"][:2]) <= set(QUEUE_SERIES), ranking
    assert incident["causes"][0]["cause"] == "queue", incident["causes"]
    # ...and the alert's own series is scored as anomalous (its rank among the rest
    # varies: a 0 -> MAX_WAITING step is z = 2 * MAX_WAITING, latency moves more).
    assert waiting["score"] >= DETECTOR_THRESHOLD, ranking
    assert waiting["direction"] == "up" and waiting["peak"] >= MAX_WAITING - 1, waiting
    assert waiting["reference"] == 0.0, waiting
    assert incident["anomaly_start"] <= incident["anomaly_end"]
    assert incident["anomaly_end"] >= flood_at, (incident["anomaly_end"], flood_at)

    # Trace ids: from the anomaly window, stored by Prometheus as the service's
    # exemplars, seen on the service's own /metrics, and naming requests it served.
    traces = {e["trace_id"] for e in incident["exemplars"]}
    assert traces, incident
    for ex in incident["exemplars"]:
        assert ex["timestamp"] >= incident["anomaly_start"] - 1.0, ex
        assert ex["metric"].startswith("moeserve_"), ex
    # slowest first: the first one is a request that queued behind the flood
    first = incident["exemplars"][0]
    assert first["timestamp"] >= flood_at and first["value"] > 0.2, incident["exemplars"]
    stored = prometheus_exemplar_trace_ids(prometheus, t0, time.time() + 1)
    assert traces <= stored, (traces - stored, len(stored))
    assert traces & scraper.trace_ids, (traces, len(scraper.trace_ids))
    finished = finished_trace_ids(service)
    assert traces <= finished, traces - finished

    print(
        f"\n{ALERT}/{SEVERITY} incident {detected_at - flood_at:.1f}s after the flood "
        f"(test {time.time() - t0:.1f}s); load {load.counts}; top {incident['top_metrics']}; "
        f"ranking {ranking[:6]}; {len(traces)} trace ids "
        f"({len(stored)} exemplars in Prometheus, {len(scraper.trace_ids)} scraped)"
    )
