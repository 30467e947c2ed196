"""The model-server protocol gauges of the Gateway API Inference Extension under vLLM's names
(SPEC section 13, Scale-out): endpoint pickers (the extension's, llm-d's) and vLLM's router read
these names off /metrics. Each has the meaning of its moeserve_ twin and is set with it
(ServiceMetrics.observe_step):

    vllm:num_requests_running   moeserve_num_requests_running
    vllm:num_requests_waiting   moeserve_num_requests_waiting
    vllm:kv_cache_usage_perc    moeserve_kv_cache_usage_ratio (0-1, as vLLM's despite the name)
    vllm:cache_config_info      {block_size, num_gpu_blocks}: the paged KV cache's shape (value 1)

and vLLM's prefix-cache counters (`VllmPrefixCacheCounters`), in tokens, beside their twins:

    vllm:prefix_cache_queries   moeserve_prefix_cache_queries_total: prompt tokens looked up
    vllm:prefix_cache_hits      moeserve_prefix_cache_hits_total: those found in the cache

(/metrics writes them with _total, as vLLM's; hits / queries is a replica's hit ratio).

Labels as vLLM's v1 engine writes them: `model_name` and `engine` (one engine: "0").
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

ENGINE = "0"  # vLLM labels each engine of a data-parallel group; we run one


LABELS = ("model_name", "engine")


class VllmProtocolGauges:
    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
    ) -> None:
        """`block_size`, `num_gpu_blocks`: the KV cache's, for vllm:cache_config_info (not
        exported while unknown)."""

        def gauge(name: str, help_text: str) -> Any:
            return Gauge(name, help_text, LABELS, registry=registry).labels(model, ENGINE)

        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent (0-1).")
        if block_size is not None and num_gpu_blocks is not None:
            info = Gauge(
                "vllm:cache_config_info",
                "The KV cache's configuration (value 1).",
                ("block_size", "num_gpu_blocks", "engine"),
                registry=registry,
            )
            info.labels(str(block_size), str(num_gpu_blocks), ENGINE).set(1)

    def observe(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Every engine step, with the moeserve_ twins' values."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv.set(kv_usage)


class VllmPrefixCacheCounters:
    """vLLM's prefix-cache counters (vllm/v1/metrics/loggers.py), counted as its scheduler does:
    when a request is admitted, its tokens as queries and the tokens its cache lookup found as
    hits; a request resumed after a preemption, or one that skips the lookup (prompt logprobs,
    prefix caching off), counts in neither."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        def counter(name: str, help_text: str) -> Any:
            return Counter(name, help_text, LABELS, registry=registry).labels(model, ENGINE)

        self._queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self._hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )

    def observe(self, queries: int, hits: int) -> None:
        """With the moeserve_ twins' increments (a step that admitted something)."""
        self._queries.inc(queries)
        self._hits.inc(hits)
