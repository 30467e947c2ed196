"""The observability stack of a scenario run, every piece real and on 127.0.0.1 free ports:
Debian's `prometheus` with the shipped recording and alert rules, `prometheus-alertmanager`
with the shipped routing, and the anomaly webhook (`bench.scenarios.webhook`, the
telemetry.anomaly app) that Alertmanager delivers to.

A run compresses time by TIME_SCALE (30): an alert that needs 2 minutes of a 5-minute rate
in production needs 4 s of a 10-s rate here. Prometheus scrapes and evaluates every
SCRAPE_S; every `for:` and every range selector in the shipped rules is divided by
TIME_SCALE (floors below); Alertmanager's group timers shrink to 1 s. The rules' expressions
and thresholds stay as shipped. bench/NOTES.md ("Fault scenarios") says why these values.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from bench.harness import HOST, REPO, ManagedProcess, free_port, prometheus_process, wait_for_http

PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "deploy" / "alertmanager" / "alertmanager.yml"

TIME_SCALE = 30  # production seconds per run second
SCRAPE_S = 1  # scrape and rule-evaluation interval (production: 5 s scrape, 15 s evaluation)
MIN_RANGE_S = 10  # a rate() needs ~10 scrapes to be more than noise
MIN_FOR_S = 2  # two evaluations
# the webhook's analysis, in the same compressed time (production: 30 min of history at 15 s
# steps, rate windows of 1 m, onset up to 5 min before the alert)
WEBHOOK = {"window_s": 150.0, "step_s": 1.0, "rate_window": "10s", "onset_lookback_s": 12.0}

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d))\]")


def seconds(duration: str) -> float:
    """A Prometheus duration ("1h30m", "5m", "10s") in seconds."""
    parts = _DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * _UNITS[u] for n, u in parts)


def compressed(duration: str, floor_s: float) -> str:
    """`duration` divided by TIME_SCALE, at least `floor_s`, in whole seconds."""
    return f"{max(floor_s, round(seconds(duration) / TIME_SCALE))}s"


def compress_rules(doc: dict[str, Any]) -> dict[str, Any]:
    """A rule file with every `for:` and every `[range]` divided by TIME_SCALE."""
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = _RANGE.sub(
                lambda m: f"[{compressed(m[1], MIN_RANGE_S)}]", str(rule["expr"])
            )
            if "for" in rule:
                rule["for"] = compressed(rule["for"], MIN_FOR_S)
    return doc


def prometheus_config(workdir: Path, target: str, alertmanager: str) -> Path:
    """deploy/prometheus/prometheus.yml for one scenario: the moeserve job scraping `target`
    every SCRAPE_S, alerts to `alertmanager` (host:port), the shipped rule files compressed
    into `workdir`. The other jobs (the compose stack's services) are dropped."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    interval = f"{SCRAPE_S}s"
    cfg["global"].update(
        scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval
    )
    rule_files = []
    for rel in cfg["rule_files"]:
        src = PROMETHEUS_YML.parent / rel
        dst = workdir / src.name
        dst.write_text(yaml.safe_dump(compress_rules(yaml.safe_load(src.read_text()))))
        rule_files.append(str(dst))
    cfg["rule_files"] = rule_files
    (am,) = cfg["alerting"]["alertmanagers"]
    am["static_configs"] = [{"targets": [alertmanager]}]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "moeserve"]
    job.update(
        scrape_interval=interval, scrape_timeout=interval, static_configs=[{"targets": [target]}]
    )
    cfg["scrape_configs"] = [job]
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def alertmanager_config(workdir: Path, webhook_url: str, timer: str = "1s") -> Path:
    """deploy/alertmanager/alertmanager.yml with its receivers pointed at `webhook_url`
    (/alerts) and the group timers of every route set to `timer`; routes and inhibitions
    as shipped."""
    cfg = yaml.safe_load(ALERTMANAGER_YML.read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url}/alerts"
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route["group_wait"] = timer
        route["group_interval"] = timer
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def alertmanager_process(binary: str, config: Path, workdir: Path, port: int) -> ManagedProcess:
    """Alertmanager with `config`, fresh storage under `workdir`, no clustering, on
    127.0.0.1:`port`; not started yet."""
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={workdir / 'alertmanager-data'}",
        f"--web.listen-address={HOST}:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    return ManagedProcess(argv, log_path=workdir / "alertmanager.log", stop_timeout=10)


def binaries() -> dict[str, str] | None:
    """Paths of prometheus and alertmanager (Debian: prometheus, prometheus-alertmanager), or
    None when either is missing."""
    prometheus = shutil.which("prometheus")
    alertmanager = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if prometheus is None or alertmanager is None:
        return None
    return {"prometheus": prometheus, "alertmanager": alertmanager}


class Stack:
    """Prometheus -> Alertmanager -> anomaly webhook for one moeserve `target` (host:port).
    A context manager: started (and waited for) on entry, stopped on exit."""

    def __init__(self, workdir: Path, target: str, bins: dict[str, str]) -> None:
        self.workdir, self.target, self.bins = workdir, target, bins
        self.prometheus_port, self.alertmanager_port, self.webhook_port = (
            free_port(),
            free_port(),
            free_port(),
        )
        self.prometheus_url = f"http://{HOST}:{self.prometheus_port}"
        self.alertmanager_url = f"http://{HOST}:{self.alertmanager_port}"
        self.webhook_url = f"http://{HOST}:{self.webhook_port}"
        self._procs: list[ManagedProcess] = []

    def __enter__(self) -> Self:
        import sys

        try:
            webhook = ManagedProcess(
                [
                    sys.executable, "-m", "bench.scenarios.webhook",
                    "--port", self.webhook_port, "--prometheus-url", self.prometheus_url,
                    *[a for k, v in WEBHOOK.items() for a in (f"--{k.replace('_', '-')}", v)],
                ],
                log_path=self.workdir / "webhook.log",
                stop_timeout=10,
                name="anomaly-webhook",
            )  # fmt: skip
            self._procs.append(webhook.start())
            am_config = alertmanager_config(self.workdir, self.webhook_url)
            am = alertmanager_process(
                self.bins["alertmanager"], am_config, self.workdir, self.alertmanager_port
            )
            self._procs.append(am.start())
            config = prometheus_config(
                self.workdir, self.target, f"{HOST}:{self.alertmanager_port}"
            )
            prom = prometheus_process(
                self.bins["prometheus"], config, self.workdir, self.prometheus_port
            )
            self._procs.append(prom.start())
            wait_for_http(f"{self.webhook_url}/health", 60, process=webhook)
            wait_for_http(f"{self.alertmanager_url}/-/ready", 30, process=am)
            wait_for_http(f"{self.prometheus_url}/-/ready", 30, process=prom)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()

    # --- what the stack saw ------------------------------------------------------------

    async def firing(self, client: httpx.AsyncClient) -> list[dict[str, str]]:
        """The alerts Prometheus has firing now (their labels)."""
        r = await client.get(
            f"{self.prometheus_url}/api/v1/query",
            params={"query": 'ALERTS{alertstate="firing"}'},
        )
        r.raise_for_status()
        return [s["metric"] for s in r.json()["data"]["result"]]

    async def incidents(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        """Every incident the webhook holds, oldest first."""
        r = await client.get(f"{self.webhook_url}/incidents", params={"limit": 1000})
        r.raise_for_status()
        return list(reversed(r.json()["incidents"]))

    async def webhook_idle(self, client: httpx.AsyncClient) -> bool:
        """No alert waiting for analysis at the webhook."""
        r = await client.get(f"{self.webhook_url}/health")
        return r.status_code == 200 and r.json()["queue_depth"] == 0

    async def query(self, client: httpx.AsyncClient, expr: str) -> float | None:
        """The sum of an instant query's values (None when it has no series)."""
        r = await client.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr})
        r.raise_for_status()
        result = r.json()["data"]["result"]
        return sum(float(s["value"][1]) for s in result) if result else None
