"""The moeserve / MoE experts dashboard: routing of tokens to experts, load per layer and
expert, imbalance over time. Laid out for 8 to 384 experts x ~60 layers: per-layer rows
(heatmap of imbalance, hot-experts table) come first; the per-layer expert heatmaps are a
drill-down in the last, collapsed row.
"""

from __future__ import annotations

from typing import Any

from dashboard_builders import (
    DRILL_DOWN,
    EXPERTS_UID,
    OVERVIEW_UID,
    PROM,
    RATE,
    REPLICAS_UID,
    SEL,
    Layout,
    common_variables,
    dashboard,
    dashboard_link,
    prom,
    query_variable,
    stat,
    timeseries,
    with_ref_ids,
)
from expert_layer_panels import expert_load_heatmap, hot_experts_table, imbalance_by_layer_heatmap

EXPERT_TOKENS = f'moeserve_moe_expert_tokens_total{{{SEL},layer=~"$layer"}}'
EXPERT_IMBALANCE = f'moeserve_moe_expert_imbalance{{{SEL},layer=~"$layer"}}'


def moe_experts() -> dict[str, Any]:
    g = Layout()
    g.row("Summary")
    for panel in summary_stats():
        g.add(panel, 6, 4)
    g.row("Per layer (exact over every expert)")
    g.add(imbalance_by_layer_heatmap(), 12, 10)
    g.add(hot_experts_table(), 12, 10)
    g.row("Expert load")
    g.add(expert_share_table(), 24, 10)
    g.row("Imbalance and tokens per expert")
    for panel in imbalance_and_token_panels():
        g.add(panel, 12, 8)
    g.row("Drill-down: expert load over time per selected layer", collapsed=True)
    g.add(expert_load_heatmap(), 12, 8)

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
        [
            dashboard_link("moeserve / Overview", OVERVIEW_UID),
            dashboard_link("moeserve / Replicas", REPLICAS_UID),
        ],
    )


def summary_stats() -> list[dict[str, Any]]:
    """Worst imbalance, routed tokens, the least uniform layer, experts per series."""
    return [
        stat(
            "Max imbalance",
            "Highest max/mean expert load over the selected layers (1 = balanced; alert above 3).",
            prom(f"max({EXPERT_IMBALANCE})"),
            "x",
            [("green", None), ("orange", 2), ("red", 3)],
            decimals=2,
            links=DRILL_DOWN,
        ),
        stat(
            "Routed tokens/s",
            "Tokens routed to experts per second, summed over layers and "
            "experts (top-k routing counts each token k times per layer).",
            prom(f"sum(rate({EXPERT_TOKENS}[{RATE}]))"),
            "short",
            [("blue", None)],
            decimals=1,
        ),
        stat(
            "Lowest load entropy",
            "Lowest normalised entropy of a selected layer's expert load (1 = uniform, "
            "towards 0 = a few experts take the layer's tokens).",
            prom(f'min(moeserve_moe_expert_load_entropy{{{SEL},layer=~"$layer"}})'),
            "none",
            [("red", None), ("orange", 0.5), ("green", 0.8)],
            decimals=3,
        ),
        stat(
            "Experts per series",
            "Experts counted under one expert label of moeserve_moe_expert_tokens_total: 1 "
            "on models whose layers x experts fit the exporter's series limit (2048), more "
            "on larger ones (DeepSeek-V3: ranges of 8). The per-layer gauges stay exact.",
            prom(f"max(moeserve_moe_expert_bucket_size{{{SEL}}})"),
            "none",
            [("blue", None)],
            decimals=0,
        ),
    ]


def expert_share_table() -> dict[str, Any]:
    """Each layer's routed tokens shared out over its experts."""
    return {
        "type": "table",
        "title": "Expert-load share: layer x expert",
        "description": "Share of each layer's routed tokens that each expert (or range of "
        "experts, past the series limit) received over the time range (a row sums to 1; "
        "equal shares everywhere is perfectly balanced). Cells are coloured by share.",
        "datasource": PROM,
        "targets": with_ref_ids(
            [
                prom(
                    f"sum by (layer, expert) (increase({EXPERT_TOKENS}[$__range])) / on (layer) group_left "
                    f"sum by (layer) (increase({EXPERT_TOKENS}[$__range]))",
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
    }


def imbalance_and_token_panels() -> list[dict[str, Any]]:
    """Imbalance over time, and routed tokens per expert and per layer."""
    return [
        timeseries(
            "Imbalance over time (max/mean expert load)",
            "Per layer: load of the busiest expert / mean expert load over about the last "
            "64 routed tokens per expert (1 = balanced, num_experts = one expert takes "
            "everything; 0 = nothing routed). The alert fires above 3 for 15 minutes.",
            [prom(f"max by (layer) ({EXPERT_IMBALANCE})", "layer {{layer}}")],
            "x",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 3)],
        ),
        tokens_per_expert_bars(),
        timeseries(
            "Busiest experts: tokens per second",
            "Routed tokens per second of the 16 busiest (layer, expert) series of the "
            "selected layers (every series of a 256-expert model would be thousands of lines).",
            [
                prom(
                    f"topk(16, sum by (layer, expert) (rate({EXPERT_TOKENS}[{RATE}])))",
                    "L{{layer}} E{{expert}}",
                )
            ],
            "short",
        ),
        timeseries(
            "Routed tokens per layer",
            "Tokens routed per second in each layer (all experts).",
            [prom(f"sum by (layer) (rate({EXPERT_TOKENS}[{RATE}]))", "layer {{layer}}")],
            "short",
        ),
    ]


def tokens_per_expert_bars() -> dict[str, Any]:
    """Tokens per expert over the time range."""
    return {
        "type": "bargauge",
        "title": "Tokens per expert (time range)",
        "description": "Tokens routed to each expert (or range of experts) over the time "
        "range, summed over the selected layers: select one layer for its own experts.",
        "datasource": PROM,
        "targets": with_ref_ids(
            [
                prom(
                    f"sum by (expert) (increase({EXPERT_TOKENS}[$__range]))",
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
    }
