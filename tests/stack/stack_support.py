"""Shared helpers of the tests/stack suite: repository paths, the dashboards and their
Prometheus queries, and the metric families the service exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.harness import free_port, prometheus_process, wait_for_http

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GRAFANA = ROOT / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
DATASOURCES_YML = GRAFANA / "provisioning" / "datasources" / "datasources.yml"
DASHBOARD_PROVIDERS_YML = GRAFANA / "provisioning" / "dashboards" / "dashboards.yml"
COMPOSE_YML = DEPLOY / "docker-compose.yml"
COMPOSE_CUDA_YML = DEPLOY / "docker-compose.cuda.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
COLLECTOR_YML = DEPLOY / "otel-collector" / "config.yaml"
TEMPO_YML = DEPLOY / "tempo" / "tempo.yaml"
LOKI_YML = DEPLOY / "loki" / "loki.yaml"
K8S_DIR = DEPLOY / "k8s"

# What the e2e test (and the dashboards' documentation) substitutes for Grafana's
# built-in variables when running a panel query outside Grafana.
RATE_INTERVAL = "1m"
RANGE = "5m"
INTERVAL = "15s"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def dashboards() -> dict[str, dict[str, Any]]:
    """file name -> dashboard JSON, for every grafana/dashboards/*.json."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_datasource_type(dashboard: dict[str, Any], ds: dict[str, Any] | None) -> str | None:
    if not ds:
        return None
    uid = ds.get("uid", "")
    if uid.startswith("$"):
        name = uid.strip("${}")
        var = next(v for v in dashboard["templating"]["list"] if v["name"] == name)
        return var["query"]
    return ds.get("type")


def prometheus_targets(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every Prometheus query of the dashboard."""
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            ds = target.get("datasource") or panel.get("datasource")
            if panel_datasource_type(dashboard, ds) == "prometheus":
                out.append((panel, target))
    return out


def all_prometheus_exprs() -> list[str]:
    return [t["expr"] for d in dashboards().values() for _, t in prometheus_targets(d)]


# Names start with a letter: "$1" in label_replace is Prometheus's, and Grafana leaves a
# name no variable has as it is.
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::(\w+))?\}|\$([A-Za-z_]\w*)")


def substitute(query: str, variables: dict[str, str]) -> str:
    """Grafana variable interpolation for running a panel query outside Grafana:
    $name, ${name} and ${name:format} (the value is used as is)."""
    builtins = {"__rate_interval": RATE_INTERVAL, "__range": RANGE, "__interval": INTERVAL}
    values = {**builtins, **variables}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for ${name} in {query!r}")
        return values[name]

    return _VAR.sub(repl, query)


def metric_families_from_text(text: str) -> dict[str, str]:
    """family name -> type, from an OpenMetrics exposition (in which *_created samples
    belong to their counter/histogram, unlike in the Prometheus text format)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return {f.name: f.type for f in text_string_to_metric_families(text)}


def service_metric_families() -> dict[str, str]:
    """Every moeserve_* family telemetry.metrics.ServiceMetrics exports (name -> type)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest

    from telemetry.api_requests import ApiRequests
    from telemetry.cost import CostCollector
    from telemetry.metrics import ServiceMetrics
    from telemetry.startup import StartupMetrics

    registry = CollectorRegistry()
    ServiceMetrics(registry, "m", num_layers=2, num_experts=4, max_waiting=8)
    StartupMetrics(registry, "m")  # registered by the server once serving
    ApiRequests(registry, "m")  # the service's, on the same registry
    registry.register(CostCollector("m", 1.0))  # with --cost-per-hour
    families = metric_families_from_text(generate_latest(registry).decode())
    return {name: kind for name, kind in families.items() if name.startswith("moeserve_")}


def sample_names(family: str, kind: str) -> list[str]:
    """The sample names a query can use for a family of this type."""
    if kind == "counter":
        return [f"{family}_total"]
    if kind in ("histogram", "gaugehistogram"):
        return [f"{family}_bucket", f"{family}_sum", f"{family}_count"]
    if kind == "summary":
        return [family, f"{family}_sum", f"{family}_count"]
    return [family]


def uses_family(expr: str, family: str, kind: str) -> bool:
    return any(re.search(rf"\b{re.escape(n)}\b", expr) for n in sample_names(family, kind))


def real_log_line() -> str:
    """A JSON line exactly as telemetry.logging writes it inside a request's span (in a
    subprocess: logging configuration is process-global)."""
    code = """
import io, sys
from telemetry.logging import configure_logging, get_logger, bind_request_context
from telemetry.tracing import configure_tracing
buf = io.StringIO()
configure_logging("json", stream=buf, cache_loggers=False)
tracer = configure_tracing(set_global=False).get_tracer("t")
from opentelemetry import trace
with trace.use_span(tracer.start_span("req"), end_on_exit=True):
    bind_request_context("req-1")
    get_logger("service.test").info("request finished", prompt_tokens=3)
sys.stdout.write(buf.getvalue())
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def serve_parser():
    """The argparse parser of `moeserve` (service/cli.py)."""
    from service.cli import build_parser

    return build_parser()


class Prometheus:
    """Debian's prometheus on a free loopback port with exemplar storage, scraping each job's
    targets (job name -> host:port list) every `interval_s` seconds."""

    def __init__(
        self, binary: str, workdir: Path, jobs: dict[str, list[str]], interval_s: int = 1
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        every = f"{interval_s}s"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {
                        "scrape_interval": every,
                        "scrape_timeout": every,
                        "evaluation_interval": every,
                    },
                    "storage": {"exemplars": {"max_exemplars": 100000}},
                    "scrape_configs": [
                        {
                            "job_name": job,
                            "metrics_path": "/metrics",
                            "static_configs": [{"targets": targets}],
                        }
                        for job, targets in jobs.items()
                    ],
                }
            )
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = prometheus_process(binary, config, workdir, self.port).start()
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def wait_ready(self) -> None:
        wait_for_http(f"{self.url}/-/ready", 30, process=self.proc)

    def api(self, path: str, **params) -> dict:
        r = self.http.get(f"/api/v1/{path}", params=params)
        body = r.json()
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> dict:
        r = self.http.get("/api/v1/query", params={"query": expr})
        return r.json()

    def stop(self) -> None:
        self.proc.stop()
        self.http.close()
