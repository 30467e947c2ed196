"""Writes grafana/dashboards/*.json, the dashboards Grafana provisions (grafana/provisioning).

    python grafana/generate_dashboards.py          # rewrite the JSON files
    python grafana/generate_dashboards.py --check  # exit 1 if they are out of date

The JSON files are the product (Grafana loads them as they are); this script only keeps
them consistent: unique panel ids, a gapless 24-column grid, the same template variables,
selectors and drill-down links everywhere. tests/stack checks that the committed files
match its output and runs every Prometheus query in them against a real Prometheus.

Conventions (tests rely on them):
- Prometheus targets use the `$datasource` variable; Loki and Tempo panels use the
  provisioned uids `loki` and `tempo` (grafana/provisioning/datasources/datasources.yml).
- Every moeserve selector carries model=~"$model" and instance=~"$instance".
- Latency panels request exemplars (trace ids) and link to Tempo and Loki in Explore.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"

SCHEMA_VERSION = 39  # Grafana 11.0 dashboard model; newer Grafana migrates it on load
PROM = {"type": "prometheus", "uid": "${datasource}"}
LOKI = {"type": "loki", "uid": "loki"}
TEMPO = {"type": "tempo", "uid": "tempo"}
SEL = 'model=~"$model",instance=~"$instance"'
RATE = "$__rate_interval"

OVERVIEW_UID = "moeserve-overview"
EXPERTS_UID = "moeserve-moe-experts"

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

    def add(self, panel: dict[str, Any], w: int, h: int) -> dict[str, Any]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {"id": self.next_id, **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        self.panels.append(panel)
        return panel

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.add({"type": "row", "title": title, "collapsed": False, "panels": []}, 24, 1)
        self.x, self.y, self.row_h = 0, self.y + 1, 0


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


# --------------------------------------------------------------------------- overview


def overview() -> dict[str, Any]:
    g = Layout()
    req = f"moeserve_requests_total{{{SEL}}}"

    g.row("Service level")
    g.add(
        stat(
            "Requests/s",
            "Finished requests per second (all APIs and outcomes).",
            prom(f"sum(rate({req}[{RATE}]))"),
            "reqps",
            [("blue", None)],
            decimals=2,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "Server error ratio",
            "Share of requests that ended in a server error (5xx / gRPC "
            "INTERNAL); client errors and 429s are not counted.",
            prom(
                f'sum(rate(moeserve_requests_total{{{SEL},status="server_error"}}[{RATE}])) '
                f"/ sum(rate({req}[{RATE}]))"
            ),
            "percentunit",
            [("green", None), ("orange", 0.01), ("red", 0.05)],
            decimals=2,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "Rejected (429)/s",
            "Requests refused because the waiting queue was full (HTTP 429 "
            "/ gRPC RESOURCE_EXHAUSTED).",
            prom(f'sum(rate(moeserve_requests_total{{{SEL},status="rejected"}}[{RATE}]))'),
            "reqps",
            [("green", None), ("red", 0.001)],
            decimals=2,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "TTFT p95",
            "95th percentile time to first token.",
            prom(
                f"histogram_quantile(0.95, sum by (le) (rate("
                f"moeserve_time_to_first_token_seconds_bucket{{{SEL}}}[{RATE}])))"
            ),
            "s",
            [("green", None), ("orange", 0.5), ("red", 1)],
            links=DRILL_DOWN,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "Output tokens/s",
            "Generated tokens per second.",
            prom(f"sum(rate(moeserve_generation_tokens_total{{{SEL}}}[{RATE}]))"),
            "short",
            [("blue", None)],
            decimals=1,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "KV cache usage",
            "Share of KV-cache blocks held by live requests.",
            prom(f"max(moeserve_kv_cache_usage_ratio{{{SEL}}})"),
            "percentunit",
            [("green", None), ("orange", 0.9), ("red", 0.98)],
            kind="gauge",
            max_=1,
        ),
        4,
        4,
    )

    g.row("Traffic")
    g.add(
        timeseries(
            "Request rate by API and status",
            "Finished requests per second by API (rest|grpc) and outcome "
            "(ok|client_error|server_error|rejected).",
            [prom(f"sum by (api, status) (rate({req}[{RATE}]))", "{{api}} {{status}}")],
            "reqps",
            stack=True,
            links=DRILL_DOWN,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Errors and rejections by status",
            "Requests that did not end ok: client errors (4xx, cancelled), server "
            "errors (5xx) and 429 rejections, by API.",
            [
                prom(
                    f'sum by (api, status) (rate(moeserve_requests_total{{{SEL},status!="ok"}}[{RATE}]))',
                    "{{api}} {{status}}",
                )
            ],
            "reqps",
            links=DRILL_DOWN,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Finish reasons",
            "Why successful requests stopped: stop (EOS / stop string), length "
            "(max_tokens or context), abort.",
            [
                prom(
                    f'sum by (finish_reason) (rate(moeserve_requests_total{{{SEL},status="ok"}}[{RATE}]))',
                    "{{finish_reason}}",
                )
            ],
            "reqps",
            stack=True,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Token throughput",
            "Output (generated) and prompt tokens per second, by API.",
            [
                prom(
                    f"sum by (api) (rate(moeserve_generation_tokens_total{{{SEL}}}[{RATE}]))",
                    "output {{api}}",
                ),
                prom(
                    f"sum by (api) (rate(moeserve_prompt_tokens_total{{{SEL}}}[{RATE}]))",
                    "prompt {{api}}",
                ),
            ],
            "short",
        ),
        12,
        8,
    )

    g.row("Latency (exemplars: click a diamond to open its trace)")
    g.add(
        timeseries(
            "Time to first token (TTFT)",
            "p50/p95/p99 from arrival to the first generated token. Exemplars carry "
            "the trace id of a request in that bucket.",
            quantiles("moeserve_time_to_first_token_seconds"),
            "s",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 1)],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Time per output token (TPOT)",
            "p50/p95/p99 of each request's mean time per output token after the first.",
            quantiles("moeserve_time_per_output_token_seconds"),
            "s",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 0.1)],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "End-to-end request latency",
            "p50/p95/p99 from arrival to the request finishing.",
            quantiles("moeserve_e2e_request_latency_seconds"),
            "s",
            links=DRILL_DOWN,
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Queue time",
            "p50/p95/p99 time requests waited before first being scheduled.",
            quantiles("moeserve_request_queue_time_seconds"),
            "s",
            links=DRILL_DOWN,
        ),
        8,
        8,
    )
    means = [
        (name, metric)
        for name, metric in (
            ("TTFT", "moeserve_time_to_first_token_seconds"),
            ("TPOT", "moeserve_time_per_output_token_seconds"),
            ("e2e", "moeserve_e2e_request_latency_seconds"),
            ("queue", "moeserve_request_queue_time_seconds"),
        )
    ]
    g.add(
        timeseries(
            "Mean latencies",
            "Mean TTFT, TPOT, end-to-end and queue time (sum / count).",
            [
                prom(
                    f"sum(rate({m}_sum{{{SEL}}}[{RATE}])) / sum(rate({m}_count{{{SEL}}}[{RATE}]))",
                    n,
                )
                for n, m in means
            ],
            "s",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Engine step time",
            "p50/p95/p99 duration of one engine step (schedule + forward + sample).",
            quantiles("moeserve_engine_step_seconds"),
            "s",
        ),
        8,
        8,
    )

    g.row("Engine and KV cache")
    g.add(
        timeseries(
            "Running / waiting requests",
            "Requests in the running batch, in the waiting queue, and the queue bound "
            "(--max-waiting) beyond which requests get 429.",
            [
                prom(f"sum(moeserve_num_requests_running{{{SEL}}})", "running"),
                prom(f"sum(moeserve_num_requests_waiting{{{SEL}}})", "waiting"),
                prom(f"sum(moeserve_max_waiting{{{SEL}}})", "max waiting"),
            ],
            "short",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Batch size",
            "Sequences per engine step: p50/p95 and mean.",
            [
                *quantiles("moeserve_batch_size")[:2],
                prom(
                    f"sum(rate(moeserve_batch_size_sum{{{SEL}}}[{RATE}])) / "
                    f"sum(rate(moeserve_batch_size_count{{{SEL}}}[{RATE}]))",
                    "mean",
                ),
            ],
            "short",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Decode step time per sequence",
            "Duration of decode-only engine steps divided by their batch size, p50/p95: the "
            "engine's speed on the same work. Up while batch size and prompt lengths are flat: "
            "the device is slower (CPU contention, throttling).",
            quantiles("moeserve_engine_decode_seconds_per_sequence")[:2],
            "s",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "KV cache usage over time",
            "Share of KV-cache blocks held by live requests, per instance (alerts at 90% / 98%).",
            [prom(f"max by (instance) (moeserve_kv_cache_usage_ratio{{{SEL}}})", "{{instance}}")],
            "percentunit",
            max_=1,
            thresholds=[("green", None), ("orange", 0.9), ("red", 0.98)],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Preemptions",
            "Sequences preempted per second (KV cache exhausted: evicted and recomputed later).",
            [
                prom(
                    f"sum by (instance) (rate(moeserve_preemptions_total{{{SEL}}}[{RATE}]))",
                    "{{instance}}",
                )
            ],
            "short",
            links=DRILL_DOWN,
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "429 rejections",
            "Requests rejected per second because the waiting queue was full, by API.",
            [
                prom(
                    f'sum by (api) (rate(moeserve_requests_total{{{SEL},status="rejected"}}[{RATE}]))',
                    "{{api}}",
                )
            ],
            "reqps",
            links=DRILL_DOWN,
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Waiting-queue saturation",
            "Waiting requests / --max-waiting, per instance (alerts at 80% / 95%).",
            [
                prom(
                    f"sum by (instance) (moeserve_num_requests_waiting{{{SEL}}}) / "
                    f"sum by (instance) (moeserve_max_waiting{{{SEL}}} > 0)",
                    "{{instance}}",
                )
            ],
            "percentunit",
            max_=1,
            thresholds=[("green", None), ("orange", 0.8), ("red", 0.95)],
        ),
        8,
        8,
    )
    g.add(
        {
            "type": "table",
            "title": "Model formats",
            "description": "What each instance serves: weight format (--quantization), KV-cache "
            "format (--kv-cache-dtype), compute dtype and device.",
            "datasource": PROM,
            "targets": with_ref_ids(
                [
                    prom(
                        "max by (instance, model, quantization, kv_cache_dtype, dtype, device) "
                        f"(moeserve_model_info{{{SEL}}})",
                        instant=True,
                        fmt="table",
                    )
                ]
            ),
            "transformations": [
                {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}
            ],
            "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": []},
            "options": {"showHeader": True},
        },
        8,
        8,
    )
    g.add(
        timeseries(
            "Model memory",
            "Bytes resident for the model per instance: weights (8-bit weights with their "
            "scales) and the KV cache's budget.",
            [
                prom(
                    f"sum by (instance, kind) (moeserve_model_memory_bytes{{{SEL}}})",
                    "{{instance}} {{kind}}",
                )
            ],
            "bytes",
            stack=True,
        ),
        8,
        8,
    )

    g.row("API keys")
    g.add(
        timeseries(
            "Requests by API key",
            "Requests per second by API key name (--api-keys-file; default: --api-key, none: "
            "no key required, unauthenticated: refused with 401) and outcome.",
            [
                prom(
                    f"sum by (key, status) (rate(moeserve_requests_total{{{SEL}}}[{RATE}]))",
                    "{{key}} {{status}}",
                )
            ],
            "reqps",
            stack=True,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Rate-limited requests by key",
            "Requests refused (429 / RESOURCE_EXHAUSTED) per second because their API key was "
            "over one of its limits: requests_per_minute, tokens_per_minute, max_concurrent.",
            [
                prom(
                    f"sum by (key, limit) (rate(moeserve_rate_limited_total{{{SEL}}}[{RATE}]))",
                    "{{key}} {{limit}}",
                )
            ],
            "reqps",
        ),
        12,
        8,
    )

    g.row("Structured outputs")
    g.add(
        timeseries(
            "Structured requests by kind",
            "Requests constrained by a grammar per second, by kind (json, json_object, regex, "
            "choice, grammar).",
            [
                prom(
                    f"sum by (kind) (rate(moeserve_structured_requests_total{{{SEL}}}[{RATE}]))",
                    "{{kind}}",
                )
            ],
            "reqps",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Grammar compile time",
            "Time compiling a constrained request's grammar, p50/p95/p99 of compiles that "
            "missed the cache (a hit takes microseconds).",
            quantiles("moeserve_grammar_compile_seconds", extra=', cache="miss"'),
            "s",
        ),
        12,
        8,
    )

    g.row("Logs and traces")
    g.add(
        timeseries(
            "Trace export",
            "Spans per second the trace exporter delivered, and spans lost before delivery by "
            "reason: queue_full (the exporter fell behind), export_failed (the collector was "
            "down, refused or timed out). Requests never wait for the exporter; drops alert "
            "as MoeserveTraceExportFailing.",
            [
                prom(
                    f"sum(rate(moeserve_trace_spans_exported_total{{{SEL}}}[{RATE}]))",
                    "exported",
                ),
                prom(
                    f"sum by (reason) (rate(moeserve_trace_spans_dropped_total{{{SEL}}}[{RATE}]))",
                    "dropped: {{reason}}",
                ),
            ],
            "short",
        ),
        24,
        6,
    )
    g.add(
        {
            "type": "logs",
            "title": "Logs of $model",
            "description": "moeserve's JSON log lines in Loki (shipped by the OpenTelemetry "
            "Collector), filtered by the dashboard's model. Expand a line and follow "
            "its trace_id link to Tempo.",
            "datasource": LOKI,
            "targets": [
                {
                    "refId": "A",
                    "datasource": LOKI,
                    "expr": LOGQL,
                    "queryType": "range",
                    "editorMode": "code",
                }
            ],
            "fieldConfig": {"defaults": {"links": []}, "overrides": []},
            "options": {
                "showTime": True,
                "wrapLogMessage": True,
                "prettifyLogMessage": False,
                "enableLogDetails": True,
                "dedupStrategy": "none",
                "sortOrder": "Descending",
                "showLabels": False,
                "showCommonLabels": False,
            },
            "links": [LOG_LINK],
        },
        24,
        10,
    )
    g.add(
        {
            "type": "table",
            "title": "Recent traces of $model",
            "description": "Server spans of recent requests in Tempo; click a trace id to open it "
            "(spans queue, prefill, decode; logs and metrics linked from there).",
            "datasource": TEMPO,
            "targets": [
                {
                    "refId": "A",
                    "datasource": TEMPO,
                    "queryType": "traceql",
                    "query": TRACEQL,
                    "limit": 20,
                    "tableType": "traces",
                }
            ],
            "fieldConfig": {"defaults": {"links": []}, "overrides": []},
            "options": {"showHeader": True, "cellHeight": "sm"},
            "links": [TRACE_LINK, SLOW_TRACE_LINK],
        },
        24,
        8,
    )

    return dashboard(
        OVERVIEW_UID,
        "moeserve / Overview",
        "Requests, latency (with trace exemplars), throughput, engine and KV-cache state, "
        "logs and traces of moeserve.",
        g.panels,
        common_variables(),
        [dashboard_link("moeserve / MoE experts", EXPERTS_UID)],
    )


# --------------------------------------------------------------------------- MoE experts


def moe_experts() -> dict[str, Any]:
    g = Layout()
    tokens = f'moeserve_moe_expert_tokens_total{{{SEL},layer=~"$layer"}}'
    imbalance = f'moeserve_moe_expert_imbalance{{{SEL},layer=~"$layer"}}'

    g.row("Summary")
    g.add(
        stat(
            "Max imbalance",
            "Highest max/mean expert load over the selected layers (1 = balanced; alert above 3).",
            prom(f"max({imbalance})"),
            "x",
            [("green", None), ("orange", 2), ("red", 3)],
            decimals=2,
            links=DRILL_DOWN,
        ),
        8,
        4,
    )
    g.add(
        stat(
            "Routed tokens/s",
            "Tokens routed to experts per second, summed over layers and "
            "experts (top-k routing counts each token k times per layer).",
            prom(f"sum(rate({tokens}[{RATE}]))"),
            "short",
            [("blue", None)],
            decimals=1,
        ),
        8,
        4,
    )
    g.add(
        stat(
            "Hottest expert share",
            "Largest share of a layer's routed tokens that one expert "
            "received over the dashboard's time range.",
            prom(
                f"max(sum by (layer, expert) (increase({tokens}[$__range])) / on (layer) group_left "
                f"sum by (layer) (increase({tokens}[$__range])))"
            ),
            "percentunit",
            [("green", None), ("orange", 0.5), ("red", 0.8)],
            decimals=1,
        ),
        8,
        4,
    )

    g.row("Expert load")
    g.add(
        {
            "type": "table",
            "title": "Expert-load share: layer x expert",
            "description": "Share of each layer's routed tokens that each expert received over the "
            "time range (a row sums to 1; 1/num_experts everywhere is perfectly "
            "balanced). Cells are coloured by share.",
            "datasource": PROM,
            "targets": with_ref_ids(
                [
                    prom(
                        f"sum by (layer, expert) (increase({tokens}[$__range])) / on (layer) group_left "
                        f"sum by (layer) (increase({tokens}[$__range]))",
                        instant=True,
                        fmt="table",
                    )
                ]
            ),
            "transformations": [
                {
                    "id": "groupingToMatrix",
                    "options": {
                        "rowField": "layer",
                        "columnField": "expert",
                        "valueField": "Value",
                        "emptyValue": "zero",
                    },
                },
                {
                    "id": "renameByRegex",
                    "options": {"regex": "layer\\\\expert", "renamePattern": "layer"},
                },
            ],
            "fieldConfig": {
                "defaults": {
                    "unit": "percentunit",
                    "decimals": 1,
                    "min": 0,
                    "max": 1,
                    "color": {"mode": "continuous-GrYlRd"},
                    "custom": {
                        "align": "center",
                        "cellOptions": {"type": "color-background", "mode": "gradient"},
                    },
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [{"color": "green", "value": None}],
                    },
                    "links": [],
                },
                "overrides": [
                    {
                        "matcher": {"id": "byName", "options": "layer"},
                        "properties": [
                            {"id": "custom.cellOptions", "value": {"type": "auto"}},
                            {"id": "unit", "value": "none"},
                        ],
                    },
                ],
            },
            "options": {
                "showHeader": True,
                "cellHeight": "sm",
                "sortBy": [{"displayName": "layer", "desc": False}],
            },
            "links": DRILL_DOWN,
        },
        24,
        10,
    )
    g.add(
        {
            "type": "heatmap",
            "title": "Expert load over time: layer $layer",
            "description": "Tokens per second routed to each expert of this layer (one row per "
            "expert). A bright row that stays bright is a hot expert.",
            "datasource": PROM,
            "repeat": "layer",
            "repeatDirection": "h",
            "maxPerRow": 4,
            "targets": with_ref_ids(
                [
                    prom(
                        f'sum by (expert) (rate(moeserve_moe_expert_tokens_total{{{SEL},layer=~"$layer"}}[{RATE}]))',
                        "{{expert}}",
                    )
                ]
            ),
            "fieldConfig": {
                "defaults": {
                    "custom": {
                        "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                        "scaleDistribution": {"type": "linear"},
                    },
                    "links": [],
                },
                "overrides": [],
            },
            "options": {
                "calculate": False,
                "cellGap": 1,
                "color": {
                    "mode": "scheme",
                    "scheme": "Oranges",
                    "fill": "dark-orange",
                    "scale": "exponential",
                    "exponent": 0.5,
                    "steps": 64,
                    "reverse": False,
                },
                "yAxis": {
                    "axisPlacement": "left",
                    "reverse": False,
                    "unit": "none",
                    "axisLabel": "expert",
                },
                "rowsFrame": {"layout": "auto"},
                "cellValues": {"unit": "short"},
                "legend": {"show": True},
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9},
            },
            "links": DRILL_DOWN,
        },
        12,
        8,
    )

    g.row("Imbalance and tokens per expert")
    g.add(
        timeseries(
            "Imbalance over time (max/mean expert load)",
            "Per layer: load of the busiest expert / mean expert load over the last "
            "engine steps (1 = balanced, num_experts = one expert takes everything; "
            "0 = nothing routed). The alert fires above 3 for 15 minutes.",
            [prom(f"max by (layer) ({imbalance})", "layer {{layer}}")],
            "x",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 3)],
        ),
        12,
        8,
    )
    g.add(
        {
            "type": "bargauge",
            "title": "Tokens per expert (time range)",
            "description": "Tokens routed to each expert over the time range, summed over the "
            "selected layers.",
            "datasource": PROM,
            "targets": with_ref_ids(
                [
                    prom(
                        f"sum by (expert) (increase({tokens}[$__range]))",
                        "expert {{expert}}",
                        instant=True,
                    )
                ]
            ),
            "fieldConfig": {
                "defaults": {
                    "unit": "short",
                    "min": 0,
                    "color": {"mode": "continuous-BlPu"},
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [{"color": "green", "value": None}],
                    },
                    "links": [],
                },
                "overrides": [],
            },
            "options": {
                "orientation": "horizontal",
                "displayMode": "gradient",
                "showUnfilled": True,
                "valueMode": "color",
                "namePlacement": "auto",
                "sizing": "auto",
                "minVizHeight": 10,
                "minVizWidth": 0,
                "maxVizHeight": 300,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            },
            "links": [],
        },
        12,
        8,
    )
    g.add(
        timeseries(
            "Tokens per expert per second",
            "Routed tokens per second for each (layer, expert).",
            [prom(f"sum by (layer, expert) (rate({tokens}[{RATE}]))", "L{{layer}} E{{expert}}")],
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Routed tokens per layer",
            "Tokens routed per second in each layer (all experts).",
            [prom(f"sum by (layer) (rate({tokens}[{RATE}]))", "layer {{layer}}")],
            "short",
        ),
        12,
        8,
    )

    variables = [
        *common_variables(),
        query_variable(
            "layer",
            "Layer",
            'label_values(moeserve_moe_expert_tokens_total{model=~"$model"}, layer)',
        ),
    ]
    return dashboard(
        EXPERTS_UID,
        "moeserve / MoE experts",
        "Routing of tokens to experts: load per layer and expert, imbalance over time.",
        g.panels,
        variables,
        [dashboard_link("moeserve / Overview", OVERVIEW_UID)],
    )


DASHBOARDS = {
    "moeserve-overview.json": overview,
    "moeserve-moe-experts.json": moe_experts,
}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT_DIR / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python grafana/generate_dashboards.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
