"""The moeserve / Replicas dashboard (issue 36): N replicas behind vLLM's router. Each replica
is one Prometheus `instance`: its traffic, share, TTFT/TPOT p99, queue, KV cache and
prefix-cache hit ratio side by side; then the router's own metrics (vllm-router's
--prometheus-port), selected by the `router` variable (its scrape instances).

A replica starved by routing shows as a share well under 1/N while the others queue; the
alert MoeserveReplicaStarved (deploy/prometheus/rules) fires on the same expressions.
"""

from __future__ import annotations

from typing import Any

from dashboard_builders import (
    DRILL_DOWN,
    EXPERTS_UID,
    OVERVIEW_UID,
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
)

REQUESTS = f"moeserve_requests_total{{{SEL}}}"
# vLLM's names (telemetry/vllm_metrics.py) carry model_name, as vLLM's own do
VLLM_SEL = 'model_name=~"$model",instance=~"$instance"'
PREFIX_HITS = f"vllm:prefix_cache_hits_total{{{VLLM_SEL}}}"
PREFIX_QUERIES = f"vllm:prefix_cache_queries_total{{{VLLM_SEL}}}"
ROUTER_SEL = 'instance=~"$router"'


def per_replica_p99(metric: str) -> dict[str, Any]:
    return prom(
        f"histogram_quantile(0.99, sum by (instance, le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
        "{{instance}}",
        exemplar=True,
    )


def replicas_dashboard() -> dict[str, Any]:
    g = Layout()
    g.row("Replicas")
    for panel in summary_stats():
        g.add(panel, 6, 4)
    g.row("Per replica (instance)")
    for panel in per_replica_panels():
        g.add(panel, 8, 8)
    g.row("Router (vllm-router)")
    for panel in router_panels():
        g.add(panel, 8, 8)
    variables = [
        *common_variables(),
        query_variable("router", "Router", "label_values(vllm_router_active_workers, instance)"),
    ]
    return dashboard(
        REPLICAS_UID,
        "moeserve / Replicas",
        "moeserve replicas behind vLLM's router: traffic, latency, queue, KV cache and "
        "prefix-cache hits per replica, and the router's own metrics.",
        g.panels,
        variables,
        [
            dashboard_link("moeserve / Overview", OVERVIEW_UID),
            dashboard_link("moeserve / MoE experts", EXPERTS_UID),
        ],
    )


def summary_stats() -> list[dict[str, Any]]:
    return [
        stat(
            "Replicas reporting",
            "Replicas whose /metrics Prometheus scrapes (one series per instance).",
            prom(f"count(moeserve_num_requests_running{{{SEL}}})"),
            "none",
            [("red", None), ("green", 1)],
        ),
        stat(
            "Workers the router finds healthy",
            "vllm_router_worker_health summed: the replicas the router sends requests to.",
            prom(f"sum(vllm_router_worker_health{{{ROUTER_SEL}}})"),
            "none",
            [("red", None), ("green", 1)],
        ),
        stat(
            "Least-served replica's share",
            "The smallest share of requests any replica finished; with N replicas an even "
            "router gives each 1/N. Far below it while others queue: starved by routing.",
            prom(
                f"min(sum by (instance) (rate({REQUESTS}[{RATE}]))) / sum(rate({REQUESTS}[{RATE}]))"
            ),
            "percentunit",
            [("red", None), ("orange", 0.1), ("green", 0.25)],
            decimals=2,
        ),
        stat(
            "Prefix-cache hit ratio",
            "Prompt tokens found in a replica's prefix cache / prompt tokens looked up, all "
            "replicas (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).",
            prom(f"sum(rate({PREFIX_HITS}[{RATE}])) / sum(rate({PREFIX_QUERIES}[{RATE}]))"),
            "percentunit",
            [("blue", None)],
            decimals=2,
            max_=1,
        ),
    ]


def per_replica_panels() -> list[dict[str, Any]]:
    return [
        timeseries(
            "Requests/s per replica",
            "Finished requests per second on each replica (all APIs and outcomes).",
            [prom(f"sum by (instance) (rate({REQUESTS}[{RATE}]))", "{{instance}}")],
            "reqps",
            stack=True,
        ),
        timeseries(
            "Share of requests per replica",
            "Each replica's share of the finished requests; 1/N each when routing is even.",
            [
                prom(
                    f"sum by (instance) (rate({REQUESTS}[{RATE}])) "
                    f"/ ignoring (instance) group_left sum(rate({REQUESTS}[{RATE}]))",
                    "{{instance}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
        timeseries(
            "Prefix-cache hit ratio per replica",
            "Prompt tokens found in the replica's prefix cache / prompt tokens it looked up "
            "(vLLM's vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total). A "
            "prefix-aware router raises it; round robin spreads a conversation's turns.",
            [
                prom(
                    f"sum by (instance) (rate({PREFIX_HITS}[{RATE}])) "
                    f"/ sum by (instance) (rate({PREFIX_QUERIES}[{RATE}]))",
                    "{{instance}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
        timeseries(
            "TTFT p99 per replica",
            "99th percentile time to first token on each replica.",
            [per_replica_p99("moeserve_time_to_first_token_seconds")],
            "s",
            links=DRILL_DOWN,
        ),
        timeseries(
            "TPOT p99 per replica",
            "99th percentile time per output token on each replica.",
            [per_replica_p99("moeserve_time_per_output_token_seconds")],
            "s",
            links=DRILL_DOWN,
        ),
        timeseries(
            "Queue depth per replica",
            "Requests waiting (vllm:num_requests_waiting's twin, the queue the HPA scales "
            "on) and running on each replica.",
            [
                prom(
                    f"max by (instance) (moeserve_num_requests_waiting{{{SEL}}})",
                    "waiting {{instance}}",
                ),
                prom(
                    f"max by (instance) (moeserve_num_requests_running{{{SEL}}})",
                    "running {{instance}}",
                ),
            ],
            "short",
        ),
        timeseries(
            "KV-cache usage per replica",
            "Share of each replica's KV-cache blocks in use.",
            [
                prom(
                    f"max by (instance) (moeserve_kv_cache_usage_ratio{{{SEL}}})",
                    "{{instance}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
    ]


def router_panels() -> list[dict[str, Any]]:
    return [
        timeseries(
            "Router requests/s by route",
            "Requests the router received, per API route (vllm_router_requests_total).",
            [
                prom(
                    f"sum by (route) (rate(vllm_router_requests_total{{{ROUTER_SEL}}}[{RATE}]))",
                    "{{route}}",
                )
            ],
            "reqps",
        ),
        timeseries(
            "Requests routed to each worker",
            "Requests the router forwarded to each replica (vllm_router_processed_requests_"
            "total, by its worker URL).",
            [
                prom(
                    "sum by (worker) "
                    f"(rate(vllm_router_processed_requests_total{{{ROUTER_SEL}}}[{RATE}]))",
                    "{{worker}}",
                )
            ],
            "reqps",
            stack=True,
        ),
        timeseries(
            "Router request duration",
            "Time from the router receiving a request to its answer ending "
            "(vllm_router_generate_duration_seconds).",
            [
                prom(
                    f"histogram_quantile({q}, sum by (le) (rate("
                    f"vllm_router_generate_duration_seconds_bucket{{{ROUTER_SEL}}}[{RATE}])))",
                    f"p{int(q * 100)}",
                )
                for q in (0.5, 0.99)
            ],
            "s",
        ),
        timeseries(
            "Worker health (router's view)",
            "1 when the router's health check passes for the worker, 0 when it is taken "
            "out of rotation (vllm_router_worker_health).",
            [
                prom(
                    f"max by (worker) (vllm_router_worker_health{{{ROUTER_SEL}}})",
                    "{{worker}}",
                )
            ],
            "none",
            max_=1,
        ),
        timeseries(
            "Prefix-routing decisions",
            "cache_aware's decisions per second by outcome, as the router labels them "
            "(prefix_hit: a worker held enough of the prompt; prefix_miss: none did).",
            [
                prom(
                    "sum by (outcome) "
                    f"(rate(vllm_router_prefix_routing_decisions_total{{{ROUTER_SEL}}}[{RATE}]))",
                    "{{outcome}}",
                )
            ],
            "ops",
            stack=True,
        ),
        timeseries(
            "Router's running requests per worker",
            "Requests the router has in flight on each worker (vllm_router_running_requests).",
            [
                prom(
                    f"sum by (worker) (vllm_router_running_requests{{{ROUTER_SEL}}})",
                    "{{worker}}",
                )
            ],
            "short",
        ),
    ]
