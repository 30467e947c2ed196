"""Building blocks of the dashboards (grafana/generate_dashboards.py writes the JSON):
datasources, the shared selector and drill-down links, the grid layout, and builders of
panels, template variables and whole dashboards.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

SCHEMA_VERSION = 39  # Grafana 11.0 dashboard model; newer Grafana migrates it on load
PROM = {"type": "prometheus", "uid": "${datasource}"}
LOKI = {"type": "loki", "uid": "loki"}
TEMPO = {"type": "tempo", "uid": "tempo"}
SEL = 'model=~"$model",instance=~"$instance"'
RATE = "$__rate_interval"

OVERVIEW_UID = "moeserve-overview"
EXPERTS_UID = "moeserve-moe-experts"
REPLICAS_UID = "moeserve-replicas"

# Drill-down: the same Explore views from every dashboard (time range of the dashboard).
# ${model:pipe}: a multi-value selection becomes a|b, "All" its allValue ".*"; unlike
# ${model:regex} it adds no backslashes, which would break the JSON of Explore links and
# LogQL/TraceQL double-quoted strings (a "." in a model name then matches any character).
TRACEQL = '{resource.service.name="moeserve" && span.gen_ai.request.model=~"${model:pipe}"}'
SLOW_TRACEQL = (
    '{resource.service.name="moeserve" && span.gen_ai.request.model=~"${model:pipe}"'
    " && duration > 1s}"
)
# `model` is a resource attribute the Collector sets on the service's log records (Loki
# stores it as structured metadata); see deploy/otel-collector/config.yaml.
LOGQL = '{service_name="moeserve"} | model=~"${model:pipe}"'


def explore_url(datasource: dict[str, str], query: dict[str, Any]) -> str:
    """An Explore link (Grafana >= 10 `panes` format) over the dashboard's time range.
    `${...}` stays unencoded so Grafana interpolates it before following the link."""
    pane = {
        "datasource": datasource["uid"],
        "queries": [{"refId": "A", "datasource": datasource, **query}],
        "range": {"from": "${__from}", "to": "${__to}"},
    }
    panes = json.dumps({"moeserve": pane}, separators=(",", ":"))
    return "/explore?schemaVersion=1&orgId=1&panes=" + quote(panes, safe="${}:,")


TRACE_LINK = {
    "title": "Traces of $model (Tempo)",
    "url": explore_url(TEMPO, {"queryType": "traceql", "query": TRACEQL, "limit": 50}),
    "targetBlank": False,
}
SLOW_TRACE_LINK = {
    "title": "Slow traces > 1 s (Tempo)",
    "url": explore_url(TEMPO, {"queryType": "traceql", "query": SLOW_TRACEQL, "limit": 50}),
    "targetBlank": False,
}
LOG_LINK = {
    "title": "Logs of $model (Loki)",
    "url": explore_url(LOKI, {"expr": LOGQL, "queryType": "range"}),
    "targetBlank": False,
}
DRILL_DOWN = [TRACE_LINK, SLOW_TRACE_LINK, LOG_LINK]


# --------------------------------------------------------------------------- builders


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0
        self.next_id = 1
        self._into = self.panels  # a collapsed row's own list once one is opened

    def add(self, panel: dict[str, Any], w: int, h: int) -> dict[str, Any]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {"id": self.next_id, **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        self._into.append(panel)
        return panel

    def row(self, title: str, *, collapsed: bool = False) -> None:
        """A row; the panels added after a collapsed one are kept inside it (Grafana
        queries them only when the row is opened), so it must be the last row."""
        if self._into is not self.panels:
            raise ValueError("a collapsed row must be the dashboard's last row")
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        row = self.add({"type": "row", "title": title, "collapsed": collapsed, "panels": []}, 24, 1)
        self.x, self.y, self.row_h = 0, self.y + 1, 0
        if collapsed:
            self._into = row["panels"]


def prom(
    expr: str,
    legend: str = "__auto",
    *,
    exemplar: bool = False,
    instant: bool = False,
    fmt: str = "time_series",
) -> dict[str, Any]:
    return {
        "datasource": PROM,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "exemplar": exemplar,
        "format": fmt,
    }


def with_ref_ids(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"refId": chr(ord("A") + i), **t} for i, t in enumerate(targets)]


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str,
    *,
    links: list[dict[str, Any]] | None = None,
    stack: bool = False,
    thresholds: list[tuple[str, float | None]] | None = None,
    min_: float | None = 0,
    max_: float | None = None,
) -> dict[str, Any]:
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": min_,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if not stack else 30,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if thresholds else "off"},
        },
        "thresholds": {"mode": "absolute", "steps": steps},
        "links": [],
    }
    if max_ is not None:
        defaults["max"] = max_
    if defaults["min"] is None:
        del defaults["min"]
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": PROM,
        "targets": with_ref_ids(targets),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "links": links or [],
    }


def stat(
    title: str,
    description: str,
    target: dict[str, Any],
    unit: str,
    thresholds: list[tuple[str, float | None]],
    *,
    decimals: int | None = None,
    links: list[dict[str, Any]] | None = None,
    kind: str = "stat",
    max_: float | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in thresholds],
        },
        "mappings": [],
        "links": [],
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if max_ is not None:
        defaults["min"], defaults["max"] = 0, max_
    options: dict[str, Any] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "auto",
    }
    if kind == "stat":
        options.update(
            {"colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto"}
        )
    else:  # gauge
        options.update({"showThresholdLabels": False, "showThresholdMarkers": True})
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": PROM,
        "targets": with_ref_ids([target]),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "links": links or [],
    }


def quantiles(metric: str, by: str = "", extra: str = "") -> list[dict[str, Any]]:
    """p50/p95/p99 of a histogram; exemplars (trace ids) requested on the p99 query."""
    labels = f"{by}, le" if by else "le"
    sel = f"{SEL}{extra}"
    return [
        prom(
            f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
            f"p{int(q * 100)}",
            exemplar=q == 0.99 and metric in EXEMPLAR_METRICS,
        )
        for q in (0.5, 0.95, 0.99)
    ]


EXEMPLAR_METRICS = {
    "moeserve_time_to_first_token_seconds",
    "moeserve_time_per_output_token_seconds",
    "moeserve_e2e_request_latency_seconds",
}


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict[str, Any]],
    variables: list[dict[str, Any]],
    links: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["moeserve"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "liveNow": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables},
        "links": links,
        "panels": panels,
    }


def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": PROM,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,  # on time range change
        "regex": "",
        "sort": 3,  # numerical ascending (layer, expert numbers)
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
    }


def common_variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "regex": "",
            "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
            "options": [],
            "refresh": 1,
            "hide": 0,
            "includeAll": False,
            "multi": False,
        },
        query_variable("model", "Model", "label_values(moeserve_num_requests_running, model)"),
        query_variable(
            "instance",
            "Instance",
            'label_values(moeserve_num_requests_running{model=~"$model"}, instance)',
        ),
    ]


def dashboard_link(title: str, uid: str) -> dict[str, Any]:
    return {
        "title": title,
        "type": "link",
        "url": f"/d/{uid}",
        "icon": "dashboard",
        "tooltip": "",
        "asDropdown": False,
        "includeVars": True,
        "keepTime": True,
        "tags": [],
        "targetBlank": False,
    }
