"""The moeserve / Overview dashboard: service level, traffic, latency (with trace
exemplars), engine and KV cache, API keys, structured outputs, logs and traces.
"""

from __future__ import annotations

from typing import Any

from dashboard_builders import (
    DRILL_DOWN,
    EXPERTS_UID,
    LOG_LINK,
    LOGQL,
    LOKI,
    OVERVIEW_UID,
    PROM,
    RATE,
    REPLICAS_UID,
    SEL,
    SLOW_TRACE_LINK,
    TEMPO,
    TRACE_LINK,
    TRACEQL,
    Layout,
    common_variables,
    dashboard,
    dashboard_link,
    prom,
    quantiles,
    stat,
    timeseries,
    with_ref_ids,
)

REQUESTS = f"moeserve_requests_total{{{SEL}}}"


def overview() -> dict[str, Any]:
    g = Layout()
    g.row("Service level")
    for panel in service_level_stats():
        g.add(panel, 4, 4)
    g.row("Traffic")
    for panel in traffic_panels():
        g.add(panel, 12, 8)
    g.row("Latency (exemplars: click a diamond to open its trace)")
    for panel in [*latency_quantile_panels(), *latency_summary_panels(), *stage_panels()]:
        g.add(panel, 8, 8)
    g.row("Engine and KV cache")
    for panel in [*engine_load_panels(), *engine_pressure_panels(), *model_panels()]:
        g.add(panel, 8, 8)
    g.add(prefix_cache_panel(), 24, 6)
    g.row("Start-up and cost")
    for panel in [*startup_panels(), cost_panel()]:
        g.add(panel, 8, 8)
    g.row("API keys")
    for panel in api_key_panels():
        g.add(panel, 12, 8)
    g.row("Structured outputs")
    for panel in structured_output_panels():
        g.add(panel, 12, 8)
    g.row("Speculative decoding")
    for panel in spec_decode_panels():
        g.add(panel, 8, 8)
    g.row("Logs and traces")
    g.add(trace_export_panel(), 24, 6)
    g.add(logs_panel(), 24, 10)
    g.add(recent_traces_panel(), 24, 8)
    return dashboard(
        OVERVIEW_UID,
        "moeserve / Overview",
        "Requests, latency (with trace exemplars), throughput, engine and KV-cache state, "
        "logs and traces of moeserve.",
        g.panels,
        common_variables(),
        [
            dashboard_link("moeserve / MoE experts", EXPERTS_UID),
            dashboard_link("moeserve / Replicas", REPLICAS_UID),
        ],
    )


def service_level_stats() -> list[dict[str, Any]]:
    """Headline numbers: traffic, errors, rejections, TTFT, throughput, KV cache."""
    return [
        stat(
            "Requests/s",
            "Finished requests per second (all APIs and outcomes).",
            prom(f"sum(rate({REQUESTS}[{RATE}]))"),
            "reqps",
            [("blue", None)],
            decimals=2,
        ),
        stat(
            "Server error ratio",
            "Share of requests that ended in a server error (5xx / gRPC "
            "INTERNAL); client errors and 429s are not counted.",
            prom(
                f'sum(rate(moeserve_requests_total{{{SEL},status="server_error"}}[{RATE}])) '
                f"/ sum(rate({REQUESTS}[{RATE}]))"
            ),
            "percentunit",
            [("green", None), ("orange", 0.01), ("red", 0.05)],
            decimals=2,
        ),
        stat(
            "Rejected (429)/s",
            "Requests refused because the waiting queue was full (HTTP 429 "
            "/ gRPC RESOURCE_EXHAUSTED).",
            prom(f'sum(rate(moeserve_requests_total{{{SEL},status="rejected"}}[{RATE}]))'),
            "reqps",
            [("green", None), ("red", 0.001)],
            decimals=2,
        ),
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
        stat(
            "Output tokens/s",
            "Generated tokens per second.",
            prom(f"sum(rate(moeserve_generation_tokens_total{{{SEL}}}[{RATE}]))"),
            "short",
            [("blue", None)],
            decimals=1,
        ),
        stat(
            "KV cache usage",
            "Share of KV-cache blocks held by live requests.",
            prom(f"max(moeserve_kv_cache_usage_ratio{{{SEL}}})"),
            "percentunit",
            [("green", None), ("orange", 0.9), ("red", 0.98)],
            kind="gauge",
            max_=1,
        ),
    ]


def traffic_panels() -> list[dict[str, Any]]:
    """Requests by API and outcome, by type and status, finish reasons, token throughput."""
    return [
        timeseries(
            "Requests by type and status",
            "API requests per second by type (REST: completion, chat, tokenize, detokenize, "
            "models; gRPC: its method) and the HTTP status or gRPC code answered.",
            [
                prom(
                    "sum by (api, request_type, http_status, grpc_code) "
                    f"(rate(moeserve_api_requests_total{{{SEL}}}[{RATE}]))",
                    "{{api}} {{request_type}} {{http_status}}{{grpc_code}}",
                )
            ],
            "reqps",
            stack=True,
        ),
        timeseries(
            "Request rate by API and status",
            "Finished requests per second by API (rest|grpc) and outcome "
            "(ok|client_error|server_error|rejected).",
            [prom(f"sum by (api, status) (rate({REQUESTS}[{RATE}]))", "{{api}} {{status}}")],
            "reqps",
            stack=True,
            links=DRILL_DOWN,
        ),
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
    ]


def latency_quantile_panels() -> list[dict[str, Any]]:
    """p50/p95/p99 of the per-request latencies."""
    return [
        timeseries(
            "Time to first token (TTFT)",
            "p50/p95/p99 from arrival to the first generated token. Exemplars carry "
            "the trace id of a request in that bucket.",
            quantiles("moeserve_time_to_first_token_seconds"),
            "s",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 1)],
        ),
        timeseries(
            "Time per output token (TPOT)",
            "p50/p95/p99 of each request's mean time per output token after the first.",
            quantiles("moeserve_time_per_output_token_seconds"),
            "s",
            links=DRILL_DOWN,
            thresholds=[("green", None), ("red", 0.1)],
        ),
        timeseries(
            "End-to-end request latency",
            "p50/p95/p99 from arrival to the request finishing.",
            quantiles("moeserve_e2e_request_latency_seconds"),
            "s",
            links=DRILL_DOWN,
        ),
        timeseries(
            "Queue time",
            "p50/p95/p99 time requests waited before first being scheduled.",
            quantiles("moeserve_request_queue_time_seconds"),
            "s",
            links=DRILL_DOWN,
        ),
    ]


def latency_summary_panels() -> list[dict[str, Any]]:
    """Mean latencies, and the engine step time."""
    means = [
        (name, metric)
        for name, metric in (
            ("TTFT", "moeserve_time_to_first_token_seconds"),
            ("TPOT", "moeserve_time_per_output_token_seconds"),
            ("e2e", "moeserve_e2e_request_latency_seconds"),
            ("queue", "moeserve_request_queue_time_seconds"),
        )
    ]
    return [
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
        timeseries(
            "Engine step time",
            "p50/p95/p99 duration of one engine step (schedule + forward + sample).",
            quantiles("moeserve_engine_step_seconds"),
            "s",
        ),
    ]


def stage_panels() -> list[dict[str, Any]]:
    """Where requests' time goes (queue, prefill, decode), and how long their contexts are."""
    stages = [
        ("queue", "moeserve_request_queue_time_seconds"),
        ("prefill", "moeserve_request_prefill_time_seconds"),
        ("decode", "moeserve_request_decode_time_seconds"),
    ]
    return [
        timeseries(
            "Request stages (p95)",
            "p95 of each stage of a request: queue (arrival to first scheduled), prefill "
            "(to the first token), decode (to the end).",
            [
                prom(
                    f"histogram_quantile(0.95, sum by (le) (rate({m}_bucket{{{SEL}}}[{RATE}])))",
                    name,
                )
                for name, m in stages
            ],
            "s",
        ),
        timeseries(
            "Context length",
            "p50 and p95 tokens of finished requests' contexts: the prompt, and prompt and "
            "output (total).",
            [
                prom(
                    f"histogram_quantile({q}, sum by (kind, le) "
                    f"(rate(moeserve_request_context_tokens_bucket{{{SEL}}}[{RATE}])))",
                    f"{{{{kind}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.95)
            ],
            "short",
        ),
    ]


def engine_load_panels() -> list[dict[str, Any]]:
    """Batch occupancy, step speed and KV-cache use."""
    return [
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
        timeseries(
            "Decode step time per sequence",
            "Duration of decode-only engine steps divided by their batch size, p50/p95: the "
            "engine's speed on the same work. Up while batch size and prompt lengths are flat: "
            "the device is slower (CPU contention, throttling).",
            quantiles("moeserve_engine_decode_seconds_per_sequence")[:2],
            "s",
        ),
        timeseries(
            "KV cache usage over time",
            "Share of KV-cache blocks held by live requests, per instance (alerts at 90% / 98%).",
            [prom(f"max by (instance) (moeserve_kv_cache_usage_ratio{{{SEL}}})", "{{instance}}")],
            "percentunit",
            max_=1,
            thresholds=[("green", None), ("orange", 0.9), ("red", 0.98)],
        ),
    ]


def prefix_cache_panel() -> dict[str, Any]:
    """What the prefix cache saves; per replica on moeserve / Replicas (vLLM's names)."""
    hits = f"moeserve_prefix_cache_hits_total{{{SEL}}}"
    queries = f"moeserve_prefix_cache_queries_total{{{SEL}}}"
    return timeseries(
        "Prefix-cache hit ratio",
        "Prompt tokens found in the prefix cache / prompt tokens looked up at admission, per "
        "instance (the twins of vLLM's vllm:prefix_cache_hits / _queries).",
        [
            prom(
                f"sum by (instance) (rate({hits}[{RATE}])) "
                f"/ sum by (instance) (rate({queries}[{RATE}]))",
                "{{instance}}",
            )
        ],
        "percentunit",
        max_=1,
    )


def engine_pressure_panels() -> list[dict[str, Any]]:
    """Signs of overload: preemptions, 429s, queue saturation."""
    return [
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
    ]


def model_panels() -> list[dict[str, Any]]:
    """What each instance serves and holds in memory."""
    return [
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
    ]


def startup_panels() -> list[dict[str, Any]]:
    """Where each instance's start went (SPEC section 13), and the start against its budget."""
    phases = stat(
        "Start-up phases",
        "Seconds each instance's last start spent per phase: load_weights (from `moeserve "
        "serve`: model files, engine process, weights), quantize, pack (weights into the "
        "kernels' layouts), kv_cache_alloc, compile (kernels, torch.compile), warmup, ready "
        "(the API built and listening). The MoeserveSlowStartup alert fires past "
        "--startup-budget.",
        prom(
            f"sum by (instance, phase) (moeserve_startup_phase_seconds{{{SEL}}})",
            "{{instance}} {{phase}}",
            instant=True,
        ),
        "s",
        [("green", None)],
        decimals=2,
        kind="bargauge",
    )
    phases["options"].update({"displayMode": "basic", "orientation": "horizontal"})
    total = stat(
        "Start-up time and budget",
        "Each instance's whole start (the phases' sum) and its --startup-budget "
        "(moeserve_startup_budget_seconds; 0: none).",
        prom(
            f"sum by (instance) (moeserve_startup_phase_seconds{{{SEL}}})",
            "{{instance}} start",
            instant=True,
        ),
        "s",
        [("green", None)],
        decimals=1,
    )
    total["targets"] = with_ref_ids(
        [
            total["targets"][0],
            prom(
                f"max by (instance) (moeserve_startup_budget_seconds{{{SEL}}})",
                "{{instance}} budget",
                instant=True,
            ),
        ]
    )
    return [phases, total]


def cost_panel() -> dict[str, Any]:
    """$/1M tokens live, where the server was given --cost-per-hour."""
    return timeseries(
        "Cost per million tokens",
        "USD per million tokens: --cost-per-hour over the tokens served in the last minute "
        "of wall time (idle time costs too), for output tokens and for prompt and output "
        "tokens (moeserve_cost_per_million_tokens; OpenCost reads the same value as "
        "llm_cost_per_million_tokens). No line: no price configured, or no token served.",
        [
            prom(
                f"max by (instance, kind) (moeserve_cost_per_million_tokens{{{SEL}}})",
                "{{instance}} {{kind}}",
            )
        ],
        "currencyUSD",
    )


def api_key_panels() -> list[dict[str, Any]]:
    """Requests and rate-limit refusals by API key."""
    return [
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
    ]


def structured_output_panels() -> list[dict[str, Any]]:
    """Grammar-constrained requests and compile times."""
    return [
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
        timeseries(
            "Grammar compile time",
            "Time compiling a constrained request's grammar, p50/p95/p99 of compiles that "
            "missed the cache (a hit takes microseconds).",
            quantiles("moeserve_grammar_compile_seconds", extra=', cache="miss"'),
            "s",
        ),
    ]


def spec_decode_panels() -> list[dict[str, Any]]:
    """What speculation buys (--speculative-config), vLLM's meanings: draft tokens accepted,
    tokens per verified sequence step, and acceptance by draft position."""
    drafts = f"moeserve_spec_decode_num_drafts_total{{{SEL}}}"
    draft_tokens = f"moeserve_spec_decode_num_draft_tokens_total{{{SEL}}}"
    accepted = f"moeserve_spec_decode_num_accepted_tokens_total{{{SEL}}}"
    per_pos = f"moeserve_spec_decode_num_accepted_tokens_per_pos_total{{{SEL}}}"
    return [
        timeseries(
            "Draft acceptance rate",
            "Accepted draft tokens / proposed draft tokens (vLLM's spec_decode acceptance "
            "rate); low: the drafts cost a wider verification step for little.",
            [
                prom(
                    f"sum(rate({accepted}[{RATE}])) / sum(rate({draft_tokens}[{RATE}]))",
                    "acceptance",
                )
            ],
            "percentunit",
            max_=1,
        ),
        timeseries(
            "Mean acceptance length",
            "Tokens a sequence gains per verification step: 1 + accepted drafts / sequences "
            "verified (vLLM's mean acceptance length; 1: speculation gains nothing).",
            [
                prom(
                    f"1 + sum(rate({accepted}[{RATE}])) / sum(rate({drafts}[{RATE}]))",
                    "tokens per step",
                )
            ],
            "short",
        ),
        timeseries(
            "Acceptance by draft position",
            "Share of verified sequences whose draft token at this position was accepted "
            "(position 0: the first draft token).",
            [
                prom(
                    f"sum by (position) (rate({per_pos}[{RATE}])) "
                    f"/ scalar(sum(rate({drafts}[{RATE}])))",
                    "position {{position}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
    ]


def trace_export_panel() -> dict[str, Any]:
    """Spans the trace exporter delivered or dropped."""
    return timeseries(
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
    )


def logs_panel() -> dict[str, Any]:
    """The service's log lines in Loki."""
    return {
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
    }


def recent_traces_panel() -> dict[str, Any]:
    """Recent server spans in Tempo."""
    return {
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
    }
