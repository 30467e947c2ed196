"""Panels of the MoE experts dashboard that stay readable at 256-384 experts x ~60
layers: one row per layer (imbalance heatmap, hot-experts table, exact over every expert
from the per-layer gauges) and the per-layer drill-down heatmap, whose rows are experts
or, past the exporter's series limit, ranges of experts (telemetry/expert_load.py).
"""

from __future__ import annotations

from typing import Any

from dashboard_builders import DRILL_DOWN, EXPERTS_UID, PROM, RATE, SEL, prom, with_ref_ids

LAYER_SEL = f'{SEL},layer=~"$layer"'
HOT_RANKS = ("1", "2", "3")  # telemetry.expert_load.HOT_EXPERTS
# a layer's row of the hot-experts table opens the drill-down on that layer
LAYER_LINK = {
    "title": "Drill down: layer ${__value.raw}",
    "url": f"/d/{EXPERTS_UID}?var-layer=${{__value.raw}}&${{model:queryparam}}"
    "&${instance:queryparam}&${__url_time_range}",
}


def heatmap(
    title: str, description: str, target: dict[str, Any], y_label: str, scheme: str
) -> dict[str, Any]:
    """A heatmap of ready-made rows (one series per row; Grafana calculates nothing)."""
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": PROM,
        "targets": with_ref_ids([target]),
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
                "scheme": scheme,
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
                "axisLabel": y_label,
            },
            "rowsFrame": {"layout": "auto"},
            "cellValues": {"unit": "short"},
            "legend": {"show": True},
            "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
        },
        "links": DRILL_DOWN,
    }


def imbalance_by_layer_heatmap() -> dict[str, Any]:
    """One row per layer: a hot layer shows however many experts the model has."""
    return heatmap(
        "Imbalance by layer",
        "Max/mean expert load of each MoE layer over time (rows: layers), exact over every "
        "expert (1 = balanced; the alert fires above 3 for 15 minutes). The hot-experts "
        "table names the experts; click its layer to drill down.",
        prom(f"max by (layer) (moeserve_moe_expert_imbalance{{{LAYER_SEL}}})", "{{layer}}"),
        "layer",
        "Reds",
    )


def hot_experts_table() -> dict[str, Any]:
    """Per layer: imbalance, entropy and the three busiest experts with their load."""
    by = "max by (model, instance, layer)"
    targets = [
        prom(f"{by} (moeserve_moe_expert_imbalance{{{LAYER_SEL}}})", instant=True, fmt="table"),
        prom(f"{by} (moeserve_moe_expert_load_entropy{{{LAYER_SEL}}})", instant=True, fmt="table"),
    ]
    for rank in HOT_RANKS:
        targets.append(
            prom(
                f'{by} (moeserve_moe_hot_expert{{{LAYER_SEL},rank="{rank}"}})',
                instant=True,
                fmt="table",
            )
        )
        targets.append(
            prom(
                f'{by} (moeserve_moe_hot_expert_load_ratio{{{LAYER_SEL},rank="{rank}"}})',
                instant=True,
                fmt="table",
            )
        )
    names = {"Value #A": "max/mean", "Value #B": "entropy"}
    for i, rank in enumerate(HOT_RANKS):
        names[f"Value #{chr(ord('C') + 2 * i)}"] = f"#{rank} expert"
        names[f"Value #{chr(ord('D') + 2 * i)}"] = f"#{rank} load/mean"
    return {
        "type": "table",
        "title": "Hot experts per layer",
        "description": "Each layer's busiest experts over the exporter's window (about 64 "
        "routed tokens per expert): expert id and its load / the mean expert load, with the "
        "layer's max/mean and normalised entropy (1 = uniform). Exact at any expert count; "
        "click a layer to drill down.",
        "datasource": PROM,
        "targets": with_ref_ids(targets),
        "transformations": [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True}, "renameByName": names},
            },
        ],
        "fieldConfig": {
            "defaults": {"decimals": 2, "custom": {"align": "auto"}, "links": []},
            "overrides": [
                {
                    "matcher": {"id": "byName", "options": "layer"},
                    "properties": [{"id": "links", "value": [LAYER_LINK]}],
                },
                {
                    "matcher": {"id": "byRegexp", "options": "#. expert"},
                    "properties": [{"id": "decimals", "value": 0}],
                },
                {
                    "matcher": {"id": "byName", "options": "max/mean"},
                    "properties": [
                        {"id": "custom.cellOptions", "value": {"type": "color-background"}},
                        {
                            "id": "thresholds",
                            "value": {
                                "mode": "absolute",
                                "steps": [
                                    {"color": "green", "value": None},
                                    {"color": "orange", "value": 2},
                                    {"color": "red", "value": 3},
                                ],
                            },
                        },
                    ],
                },
            ],
        },
        "options": {
            "showHeader": True,
            "cellHeight": "sm",
            "sortBy": [{"displayName": "max/mean", "desc": True}],
        },
        "links": DRILL_DOWN,
    }


def expert_load_heatmap() -> dict[str, Any]:
    """Tokens per expert (or range of experts) over time, one heatmap per selected layer.
    Rows are named by their first expert so Grafana orders them numerically."""
    rate = f"sum by (expert) (rate(moeserve_moe_expert_tokens_total{{{LAYER_SEL}}}[{RATE}]))"
    panel = heatmap(
        "Expert load over time: layer $layer",
        "Tokens per second routed to each expert of this layer (one row per expert, or per "
        "range of moeserve_moe_expert_bucket_size experts on models past the series limit; "
        "a row is named by its first expert). A bright row that stays bright is a hot expert.",
        prom(f'label_replace({rate}, "first", "$1", "expert", "([0-9]+).*")', "{{first}}"),
        "expert",
        "Oranges",
    )
    return {**panel, "repeat": "layer", "repeatDirection": "h", "maxPerRow": 4}
