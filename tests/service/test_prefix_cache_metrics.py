"""Prefix-cache hit counters (issue 36), vLLM's names and meanings beside their moeserve_ twins:
vllm:prefix_cache_queries / vllm:prefix_cache_hits count, in tokens, what each admitted request
looked up in the prefix cache and what it found there. Checked against the engine's block
manager (a repeated prompt hits its shared full blocks), through a preemption (a resumed
sequence is not counted again), a prompt-logprobs request (no lookup: not counted), and on a
served engine's /metrics in both exposition formats."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from inference import LLMEngine, SamplingParams
from inference.block_manager import _chain_hash
from telemetry.metrics import ServiceMetrics, render_metrics

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TWINS = {
    "vllm:prefix_cache_queries_total": "moeserve_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "moeserve_prefix_cache_hits_total",
}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _samples(text: str, openmetrics: bool = False) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in (parse_openmetrics if openmetrics else parse_text)(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _counters(text: str, openmetrics: bool = False) -> dict[str, float]:
    """Each twin's value, after checking the vLLM-named counter equals it."""
    samples = _samples(text, openmetrics)
    values = {}
    for ours, twin in TWINS.items():
        (vllm_sample,), (twin_sample,) = samples[ours], samples[twin]
        assert vllm_sample.value == twin_sample.value, ours
        assert vllm_sample.labels == {"model_name": twin_sample.labels["model"], "engine": "0"}
        values[ours.removeprefix("vllm:prefix_cache_").removesuffix("_total")] = vllm_sample.value
    return values


def _step(queries: int, hits: int) -> SimpleNamespace:
    return SimpleNamespace(
        duration_s=0.01, num_running=1, num_waiting=0, batch_size=1, num_prefill_tokens=queries,
        num_decode_tokens=0, num_generated_tokens=1, kv_usage=0.1, num_preemptions=0,
        request_ids=[], expert_tokens=None, finished=[],
        prefix_cache_queries=queries, prefix_cache_hits=hits,
    )  # fmt: skip


@pytest.mark.parametrize("accept", [None, OPENMETRICS])
def test_the_counters_and_their_twins_add_up_each_step_in_both_formats(accept):
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "tiny", 1, 2, 8)
    body, content_type = render_metrics(registry, accept)
    assert _counters(body.decode(), "openmetrics" in content_type) == {"queries": 0, "hits": 0}
    for queries, hits in [(40, 0), (40, 32), (0, 0), (17, 16)]:
        metrics.observe_step(_step(queries, hits))
    body, content_type = render_metrics(registry, accept)
    text = body.decode()
    assert _counters(text, "openmetrics" in content_type) == {"queries": 97, "hits": 48}
    # samples keep the colon (prometheus_client's OpenMetrics escaping would otherwise write
    # vllm_prefix_cache_hits_total: telemetry.metrics.render_metrics)
    assert "vllm_prefix_cache" not in text


def _full_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chained hashes of the blocks a lookup may reuse: full ones, never the last token."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - 1 - block_size + 1, block_size):
        parent = _chain_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Runs `requests` to the end; (queries, hits) summed over the steps, and the outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    queries = hits = 0
    final = {}
    while engine.has_unfinished:
        outputs, stats = engine.step()
        queries += stats.prefix_cache_queries
        hits += stats.prefix_cache_hits
        final.update({o.request_id: o for o in outputs if o.finished})
    return queries, hits, final


def test_a_repeated_prompt_hits_its_shared_full_blocks(tiny_model_dir):
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=1024, max_model_len=256
    )
    bm, size = engine.block_manager, engine.block_manager.block_size
    rng = random.Random(7)
    prompt = [rng.randrange(3, engine.args.vocab_size) for _ in range(2 * size + 9)]
    assert _run(engine, {"first": (prompt, GREEDY)})[:2] == (len(prompt), 0)
    shared = _full_block_hashes(prompt, size)
    assert shared and all(h in bm.block_of for h in shared)  # the blocks the repeat can reuse
    queries, hits, final = _run(engine, {"again": (prompt, GREEDY)})
    assert (queries, hits) == (len(prompt), len(shared) * size)
    assert final["again"].num_cached_tokens == hits
    # a prompt that shares only the first block hits that block alone
    forked = prompt[:size] + [t + 1 for t in prompt[size:]]
    assert _run(engine, {"fork": (forked, GREEDY)})[:2] == (len(forked), size)
    # prompt logprobs read every position: no lookup, nothing counted (as vLLM skips them)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
    assert _run(engine, {"scored": (prompt, scored)})[:2] == (0, 0)


def test_a_preempted_sequence_is_counted_once(tiny_model_dir):
    # 6 blocks of 16 for four prompts growing by 24 tokens each: sequences get preempted
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=96,
        max_num_batched_tokens=32, max_model_len=96,
    )  # fmt: skip
    preempted = []
    engine.scheduler.on_preempt = preempted.append
    rng = random.Random(3)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = {
        f"r{i}": ([rng.randrange(3, engine.args.vocab_size) for _ in range(n)], params)
        for i, n in enumerate([20, 25, 30, 35])
    }
    queries, hits, final = _run(engine, prompts)
    assert preempted and len(final) == 4
    assert queries == sum(len(p) for p, _ in prompts.values())  # each admission counted once
    assert hits == sum(o.num_cached_tokens for o in final.values())


def test_a_served_engine_counts_a_repeated_prompt(server, http):
    rng = random.Random(11)
    prompt = [rng.randrange(3, server.state.engine.args.vocab_size) for _ in range(41)]
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    block = server.state.engine.block_size
    before = _counters(http.get("/metrics").text)
    for _ in range(2):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    response = http.get("/metrics", headers={"Accept": OPENMETRICS})
    after = _counters(response.text, openmetrics=True)
    assert after["queries"] - before["queries"] == 2 * len(prompt)
    assert after["hits"] - before["hits"] == (len(prompt) - 1) // block * block
