"""Static checks of the Grafana dashboards (grafana/dashboards) and provisioning
(grafana/provisioning): schema, ids, datasources, variables, metric coverage, drill-down
links. tests/stack/test_stack_e2e.py runs every query against a real Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from stack_support import (
    COMPOSE_YML,
    DASHBOARD_PROVIDERS_YML,
    DATASOURCES_YML,
    GRAFANA,
    all_prometheus_exprs,
    dashboards,
    iter_panels,
    load_yaml,
    prometheus_targets,
    real_log_line,
    service_metric_families,
    substitute,
    uses_family,
)

# --------------------------------------------------------------------------- schema

# The dashboard model of Grafana's schemaVersion 39 (Grafana 11.0; later versions migrate
# it on load), as far as these dashboards use it: the required fields and the types and
# enumerations Grafana's own schema (kinds/dashboard) fixes for them.
_STR_LIST = {"type": "array", "items": {"type": "string"}}
_DATASOURCE_REF = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"type": "string"}, "uid": {"type": "string"}},
}
_LINK = {
    "type": "object",
    "required": ["title", "url"],
    "properties": {
        "title": {"type": "string"},
        "url": {"type": "string"},
        "targetBlank": {"type": "boolean"},
    },
}
_THRESHOLDS = {
    "type": "object",
    "required": ["mode", "steps"],
    "properties": {
        "mode": {"enum": ["absolute", "percentage"]},
        "steps": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["color", "value"],
                "properties": {"color": {"type": "string"}, "value": {"type": ["number", "null"]}},
            },
        },
    },
}
_GRID_POS = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "properties": {
        "h": {"type": "integer", "minimum": 1},
        "w": {"type": "integer", "minimum": 1, "maximum": 24},
        "x": {"type": "integer", "minimum": 0, "maximum": 23},
        "y": {"type": "integer", "minimum": 0},
    },
}
_TARGET = {
    "type": "object",
    "required": ["refId"],
    "properties": {
        "refId": {"type": "string", "minLength": 1},
        "datasource": _DATASOURCE_REF,
        "expr": {"type": "string", "minLength": 1},
        "format": {"enum": ["time_series", "table", "heatmap"]},
        "instant": {"type": "boolean"},
        "range": {"type": "boolean"},
        "exemplar": {"type": "boolean"},
        "legendFormat": {"type": "string"},
    },
}
_PANEL = {
    "type": "object",
    "required": [
        "id",
        "type",
        "title",
        "gridPos",
        "datasource",
        "targets",
        "fieldConfig",
        "options",
    ],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 4294967295},
        "type": {
            "enum": [
                "timeseries",
                "stat",
                "gauge",
                "bargauge",
                "table",
                "heatmap",
                "logs",
                "text",
                "barchart",
                "piechart",
                "state-timeline",
                "traces",
            ]
        },
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "gridPos": _GRID_POS,
        "datasource": _DATASOURCE_REF,
        "targets": {"type": "array", "minItems": 1, "items": _TARGET},
        "fieldConfig": {
            "type": "object",
            "required": ["defaults", "overrides"],
            "properties": {
                "defaults": {
                    "type": "object",
                    "properties": {
                        "unit": {"type": "string"},
                        "decimals": {"type": "integer"},
                        "min": {"type": "number"},
                        "max": {"type": "number"},
                        "thresholds": _THRESHOLDS,
                        "links": {"type": "array", "items": _LINK},
                        "custom": {"type": "object"},
                        "color": {"type": "object"},
                        "mappings": {"type": "array"},
                    },
                },
                "overrides": {
                    "type": "array",
                    "items": {"type": "object", "required": ["matcher", "properties"]},
                },
            },
        },
        "options": {"type": "object"},
        "links": {"type": "array", "items": _LINK},
        "transformations": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "options"],
                "properties": {"id": {"type": "string"}, "options": {"type": "object"}},
            },
        },
        "repeat": {"type": "string"},
        "repeatDirection": {"enum": ["h", "v"]},
        "maxPerRow": {"type": "integer", "minimum": 1},
    },
}
_ROW = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos", "collapsed", "panels"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"const": "row"},
        "title": {"type": "string"},
        "gridPos": _GRID_POS,
        "collapsed": {"type": "boolean"},
        "panels": {"type": "array"},
    },
}
_VARIABLE = {
    "type": "object",
    "required": ["name", "type", "hide"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "type": {
            "enum": [
                "query",
                "adhoc",
                "groupby",
                "constant",
                "datasource",
                "interval",
                "textbox",
                "custom",
                "system",
                "snapshot",
            ]
        },
        "hide": {"enum": [0, 1, 2]},
        "label": {"type": "string"},
        "refresh": {"enum": [0, 1, 2]},
        "sort": {"type": "integer", "minimum": 0, "maximum": 8},
        "multi": {"type": "boolean"},
        "includeAll": {"type": "boolean"},
        "allValue": {"type": "string"},
    },
    "allOf": [
        {
            "if": {"properties": {"type": {"const": "query"}}},
            "then": {"required": ["datasource", "query", "refresh"]},
        },
        {
            "if": {"properties": {"type": {"const": "datasource"}}},
            "then": {"required": ["query"], "properties": {"query": {"type": "string"}}},
        },
    ],
}
DASHBOARD_SCHEMAS = {
    39: {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": [
            "uid",
            "title",
            "schemaVersion",
            "panels",
            "templating",
            "time",
            "editable",
            "graphTooltip",
            "annotations",
            "links",
            "tags",
        ],
        "properties": {
            "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
            "title": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "schemaVersion": {"const": 39},
            "version": {"type": "integer", "minimum": 0},
            "editable": {"type": "boolean"},
            "graphTooltip": {"enum": [0, 1, 2]},
            "tags": _STR_LIST,
            "timezone": {"type": "string"},
            "refresh": {"type": "string"},
            "time": {
                "type": "object",
                "required": ["from", "to"],
                "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
            },
            "timepicker": {"type": "object"},
            "templating": {
                "type": "object",
                "required": ["list"],
                "properties": {"list": {"type": "array", "items": _VARIABLE}},
            },
            "annotations": {
                "type": "object",
                "required": ["list"],
                "properties": {"list": {"type": "array"}},
            },
            "links": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["title", "type"],
                    "properties": {
                        "type": {"enum": ["link", "dashboards"]},
                        "title": {"type": "string"},
                        "url": {"type": "string"},
                        "includeVars": {"type": "boolean"},
                        "keepTime": {"type": "boolean"},
                    },
                },
            },
            "panels": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "if": {"properties": {"type": {"const": "row"}}},
                    "then": _ROW,
                    "else": _PANEL,
                },
            },
        },
    }
}

DASHBOARDS = dashboards()
EXPECTED_TITLES = {"moeserve / Overview", "moeserve / MoE experts", "moeserve / Replicas"}
# Each family's selector honours the dashboard's variables: ours (model, instance), vLLM's
# names (model_name, instance) and vllm-router's own series (its scrape instance: $router).
SELECTOR_RULES = {
    r"moeserve_\w+": ('model=~"$model"', 'instance=~"$instance"'),
    r"vllm:\w+": ('model_name=~"$model"', 'instance=~"$instance"'),
    r"vllm_router_\w+": ('instance=~"$router"',),
}


def by_title(title: str) -> dict:
    return next(d for d in DASHBOARDS.values() if d["title"] == title)


def test_dashboards_present():
    assert {d["title"] for d in DASHBOARDS.values()} == EXPECTED_TITLES


def test_dashboards_match_their_generator():
    proc = subprocess.run(
        [sys.executable, str(GRAFANA / "generate_dashboards.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_is_valid_for_its_schema_version(name):
    jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema (dev extra)")
    dashboard = DASHBOARDS[name]
    version = dashboard["schemaVersion"]
    assert version in DASHBOARD_SCHEMAS, f"no schema for schemaVersion {version}"
    jsonschema.validate(dashboard, DASHBOARD_SCHEMAS[version])
    # The JSON Grafana gets is exactly the file: plain JSON, no comments or trailing commas.
    json.loads((GRAFANA / "dashboards" / name).read_text())


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_ids_unique_and_grid_consistent(name):
    dashboard = DASHBOARDS[name]
    panels = list(iter_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(uids) == len(set(uids))
    for panel in panels:
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


def provisioned_datasources() -> dict[str, dict]:
    doc = load_yaml(DATASOURCES_YML)
    assert doc["apiVersion"] == 1
    return {ds["uid"]: ds for ds in doc["datasources"]}


def test_provisioned_datasources():
    sources = provisioned_datasources()
    assert {ds["type"] for ds in sources.values()} >= {"prometheus", "tempo", "loki"}
    assert sum(ds.get("isDefault", False) for ds in sources.values()) == 1
    compose = load_yaml(COMPOSE_YML)["services"]
    for ds in sources.values():
        host = urlsplit(ds["url"]).hostname
        assert host in compose, f"datasource {ds['name']} points at unknown service {host}"


def datasource_refs(dashboard: dict):
    """Every datasource reference of a dashboard: panels, targets, variables, Explore links."""
    for panel in iter_panels(dashboard):
        if panel.get("datasource"):
            yield panel["title"], panel["datasource"]
        for target in panel.get("targets", []):
            if target.get("datasource"):
                yield panel["title"], target["datasource"]
        links = panel.get("links", []) + panel.get("fieldConfig", {}).get("defaults", {}).get(
            "links", []
        )
        for link in links:
            for pane in explore_panes(link["url"]):
                yield f"{panel['title']} link {link['title']}", {"uid": pane["datasource"]}
                for query in pane["queries"]:
                    yield f"{panel['title']} link {link['title']}", query["datasource"]
    for var in dashboard["templating"]["list"]:
        if var.get("datasource"):
            yield f"variable {var['name']}", var["datasource"]


def explore_panes(url: str) -> list[dict]:
    if not url.startswith("/explore"):
        return []
    panes = parse_qs(urlsplit(url).query)["panes"][0]
    return list(json.loads(unquote(panes)).values())


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_datasource_uids_exist_in_provisioning(name):
    dashboard = DASHBOARDS[name]
    sources = provisioned_datasources()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for where, ref in datasource_refs(dashboard):
        uid = ref["uid"]
        if uid.startswith("$"):
            var = variables[uid.strip("${}")]
            assert var["type"] == "datasource", where
            assert any(ds["type"] == var["query"] for ds in sources.values()), where
            default = var["current"]["value"]
            assert sources[default]["type"] == var["query"], where
        elif uid != "-- Grafana --":
            assert uid in sources, f"{where}: datasource uid {uid!r} is not provisioned"
            if "type" in ref:
                assert sources[uid]["type"] == ref["type"], where


def test_datasource_cross_links():
    sources = provisioned_datasources()
    by_type = {ds["type"]: ds for ds in sources.values()}
    prom, tempo, loki = by_type["prometheus"], by_type["tempo"], by_type["loki"]
    # Prometheus exemplars -> Tempo, by the trace_id exemplar label the service sets.
    (dest,) = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["name"] == "trace_id" and dest["datasourceUid"] == tempo["uid"]
    # Tempo -> Loki logs of the trace, and -> Prometheus metrics.
    t2l = tempo["jsonData"]["tracesToLogsV2"]
    assert t2l["datasourceUid"] == loki["uid"] and t2l["filterByTraceID"]
    assert not t2l.get("customQuery")
    # Loki's stream label for the OTLP resource attribute service.name is service_name.
    assert {"key": "service.name", "value": "service_name"} in t2l["tags"]
    t2m = tempo["jsonData"]["tracesToMetrics"]
    assert t2m["datasourceUid"] == prom["uid"] and t2m["queries"]
    families = service_metric_families()
    for query in t2m["queries"]:
        assert "$$__tags" in query["query"], query["name"]
        assert any(uses_family(query["query"], f, k) for f, k in families.items()), query["name"]
    # Loki derived field trace_id -> Tempo.
    (field,) = loki["jsonData"]["derivedFields"]
    assert field["datasourceUid"] == tempo["uid"] and field["url"] == "$${__value.raw}"


def test_loki_derived_field_matches_real_log_lines():
    line = real_log_line()
    record = json.loads(line)
    (field,) = provisioned_datasources()["loki"]["jsonData"]["derivedFields"]
    match = re.search(field["matcherRegex"], line)
    assert match and match.group(1) == record["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", record["trace_id"])


def test_dashboard_provider_matches_compose_mount():
    provider = load_yaml(DASHBOARD_PROVIDERS_YML)["providers"][0]
    grafana = load_yaml(COMPOSE_YML)["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts[provider["options"]["path"]] == "../grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "../grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (GRAFANA / "dashboards" / home.rsplit("/", 1)[1]).is_file()


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_template_variables(name):
    dashboard = DASHBOARDS[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("model", "instance"):
        assert variables[var]["type"] == "query"
        assert variables[var]["datasource"]["uid"] == "${datasource}"
        assert variables[var]["allValue"] == ".*"
    # Every selector honours the model and instance variables (the router's: $router).
    for panel, target in prometheus_targets(dashboard):
        for family, matchers in SELECTOR_RULES.items():
            for selector in re.findall(rf"{family}\{{([^}}]*)\}}", target["expr"]):
                assert all(m in selector for m in matchers), (panel["title"], target["expr"])
        assert re.findall("|".join(SELECTOR_RULES), target["expr"]), panel["title"]
        # Runnable once Grafana's variables are substituted.
        substitute(target["expr"], {"model": "m", "instance": ".*", "layer": ".*", "router": ".*"})


def test_every_exported_metric_appears_in_a_panel():
    exprs = all_prometheus_exprs()
    families = service_metric_families()
    assert len(families) >= 15
    missing = [f for f, kind in families.items() if not any(uses_family(e, f, kind) for e in exprs)]
    assert not missing, f"metrics without a panel: {missing}"


def panel(dashboard: dict, title: str) -> dict:
    matches = [p for p in iter_panels(dashboard) if p["title"] == title]
    assert len(matches) == 1, title
    return matches[0]


def exprs_of(p: dict) -> str:
    return "\n".join(t.get("expr", "") for t in p["targets"])


def test_overview_panels():
    d = by_title("moeserve / Overview")
    rate = panel(d, "Request rate by API and status")
    assert "sum by (api, status)" in exprs_of(rate) and "moeserve_requests_total" in exprs_of(rate)
    for title, metric in (
        ("Time to first token (TTFT)", "moeserve_time_to_first_token_seconds"),
        ("Time per output token (TPOT)", "moeserve_time_per_output_token_seconds"),
        ("End-to-end request latency", "moeserve_e2e_request_latency_seconds"),
    ):
        p = panel(d, title)
        assert [t["legendFormat"] for t in p["targets"]] == ["p50", "p95", "p99"]
        assert all(f"{metric}_bucket" in t["expr"] for t in p["targets"])
        assert any(t["exemplar"] for t in p["targets"]), f"{title}: exemplars not shown"
    assert "moeserve_generation_tokens_total" in exprs_of(panel(d, "Output tokens/s"))
    assert "moeserve_request_queue_time_seconds_bucket" in exprs_of(panel(d, "Queue time"))
    running = exprs_of(panel(d, "Running / waiting requests"))
    assert "moeserve_num_requests_running" in running and "moeserve_num_requests_waiting" in running
    assert "moeserve_batch_size_bucket" in exprs_of(panel(d, "Batch size"))
    assert "moeserve_kv_cache_usage_ratio" in exprs_of(panel(d, "KV cache usage over time"))
    assert "moeserve_preemptions_total" in exprs_of(panel(d, "Preemptions"))
    assert 'status="rejected"' in exprs_of(panel(d, "429 rejections"))
    assert 'status!="ok"' in exprs_of(panel(d, "Errors and rejections by status"))
    logs = panel(d, "Logs of $model")
    assert logs["type"] == "logs" and logs["datasource"]["type"] == "loki"
    assert re.search(r'\| model=~"\$\{model:pipe\}"', logs["targets"][0]["expr"])
    traces = panel(d, "Recent traces of $model")
    assert (
        traces["datasource"]["type"] == "tempo" and "${model:pipe}" in traces["targets"][0]["query"]
    )


def test_moe_panels():
    d = by_title("moeserve / MoE experts")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert "moeserve_moe_expert_tokens_total" in variables["layer"]["definition"]
    heatmap = panel(d, "Expert load over time: layer $layer")
    assert heatmap["type"] == "heatmap" and heatmap["repeat"] == "layer"
    assert "sum by (expert)" in exprs_of(heatmap)
    matrix = panel(d, "Expert-load share: layer x expert")
    assert matrix["transformations"][0]["id"] == "groupingToMatrix"
    assert "moeserve_moe_expert_imbalance" in exprs_of(
        panel(d, "Imbalance over time (max/mean expert load)")
    )
    assert "sum by (expert)" in exprs_of(panel(d, "Tokens per expert (time range)"))


def test_moe_panels_stay_readable_at_hundreds_of_experts():
    """256-384 experts x ~60 layers: the first rows have one row per layer (exact
    per-layer gauges), the per-layer expert heatmaps wait in the last, collapsed row, and
    no range query draws a line per (layer, expert)."""
    d = by_title("moeserve / MoE experts")
    rows = [p for p in d["panels"] if p["type"] == "row"]
    drill = rows[-1]
    assert drill["collapsed"] and d["panels"][-1] is drill
    assert [p["title"] for p in drill["panels"]] == ["Expert load over time: layer $layer"]
    by_layer = panel(d, "Imbalance by layer")
    assert by_layer["type"] == "heatmap" and "max by (layer)" in exprs_of(by_layer)
    hot = panel(d, "Hot experts per layer")
    for metric in (
        "moeserve_moe_expert_imbalance",
        "moeserve_moe_expert_load_entropy",
        "moeserve_moe_hot_expert",
        "moeserve_moe_hot_expert_load_ratio",
    ):
        assert re.search(rf"\b{metric}\{{", exprs_of(hot)), metric
    assert all(t["instant"] and t["format"] == "table" for t in hot["targets"])
    for p in iter_panels(d):
        for t in p.get("targets", []):
            keeps_both = re.search(r"by \((?:layer, expert|expert, layer)\)", t.get("expr", ""))
            if keeps_both and not t["instant"]:
                assert t["expr"].startswith("topk("), (p["title"], t["expr"])


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_drill_down_links(name):
    """Panels link to the trace view (Tempo) and the log view (Loki) in Explore, and the
    dashboards link to each other."""
    dashboard = DASHBOARDS[name]
    linked = {"tempo": 0, "loki": 0}
    for p in iter_panels(dashboard):
        for link in p.get("links", []):
            for pane in explore_panes(link["url"]):
                linked[pane["datasource"]] += 1
                for query in pane["queries"]:
                    text = query.get("query") or query.get("expr")
                    assert "${model:pipe}" in text and "${__from}" in link["url"]
    assert linked["tempo"] and linked["loki"], linked
    other = {d["uid"] for d in DASHBOARDS.values()} - {dashboard["uid"]}
    assert {link["url"].rsplit("/", 1)[1] for link in dashboard["links"]} == other


def test_panel_queries_have_balanced_brackets():
    # A cheap syntax guard for generator slips; the e2e test runs every query for real.
    pairs = {")": "(", "]": "[", "}": "{"}
    for expr in all_prometheus_exprs():
        stack: list[str] = []
        for ch in re.sub(r'"[^"]*"', '""', expr):
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], expr
        assert not stack, expr
