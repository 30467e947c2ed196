"""The moeserve / MoE experts dashboard: routing of tokens to experts, load per layer and
expert, imbalance over time.
"""

from __future__ import annotations

from typing import Any

from dashboard_builders import (
    DRILL_DOWN,
    EXPERTS_UID,
    OVERVIEW_UID,
    PROM,
    RATE,
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

EXPERT_TOKENS = f'moeserve_moe_expert_tokens_total{{{SEL},layer=~"$layer"}}'
EXPERT_IMBALANCE = f'moeserve_moe_expert_imbalance{{{SEL},layer=~"$layer"}}'


def moe_experts() -> dict[str, Any]:
    g = Layout()
    g.row("Summary")
    for panel in summary_stats():
        g.add(panel, 8, 4)
    g.row("Expert load")
    g.add(expert_share_table(), 24, 10)
    g.add(expert_load_heatmap(), 12, 8)
    g.row("Imbalance and tokens per expert")
    for panel in imbalance_and_token_panels():
        g.add(panel, 12, 8)

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


def summary_stats() -> list[dict[str, Any]]:
    """Worst imbalance, routed tokens, the hottest expert's share."""
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
            "Hottest expert share",
            "Largest share of a layer's routed tokens that one expert "
            "received over the dashboard's time range.",
            prom(
                f"max(sum by (layer, expert) (increase({EXPERT_TOKENS}[$__range])) / on (layer) group_left "
                f"sum by (layer) (increase({EXPERT_TOKENS}[$__range])))"
            ),
            "percentunit",
            [("green", None), ("orange", 0.5), ("red", 0.8)],
            decimals=1,
        ),
    ]


def expert_share_table() -> dict[str, Any]:
    """Each layer's routed tokens shared out over its experts."""
    return {
        "type": "table",
        "title": "Expert-load share: layer x expert",
        "description": "Share of each layer's routed tokens that each expert received over the "
        "time range (a row sums to 1; 1/num_experts everywhere is perfectly "
        "balanced). Cells are coloured by share.",
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


def expert_load_heatmap() -> dict[str, Any]:
    """Tokens per expert over time, one heatmap per layer."""
    return {
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
    }


def imbalance_and_token_panels() -> list[dict[str, Any]]:
    """Imbalance over time, and routed tokens per expert and per layer."""
    return [
        timeseries(
            "Imbalance over time (max/mean expert load)",
            "Per layer: load of the busiest expert / mean expert load over the last "
            "engine steps (1 = balanced, num_experts = one expert takes everything; "
            "0 = nothing routed). The alert fires above 3 for 15 minutes.",
            [prom(f"max by (layer) ({EXPERT_IMBALANCE})", "layer {{layer}}")],
            "x",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 3)],
        ),
        tokens_per_expert_bars(),
        timeseries(
            "Tokens per expert per second",
            "Routed tokens per second for each (layer, expert).",
            [
                prom(
                    f"sum by (layer, expert) (rate({EXPERT_TOKENS}[{RATE}]))",
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
        "description": "Tokens routed to each expert over the time range, summed over the "
        "selected layers.",
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
