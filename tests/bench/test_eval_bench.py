"""bench/eval_bench.py's 8-bit KV rows read the 8-bit cache back while scoring (issue 39).

A prompt prefilled whole attends to the keys and values it has just computed: its prompt
logprobs on an 8-bit cache are bit for bit bf16's, whatever the cache stores. Under the rows'
own `moeserve serve` flags (a small --max-num-batched-tokens), every chunk after the first
reads its context from the cache: the scores move away from a bf16 cache's under the same
chunking, by a little. And a run of some formats only (`--formats kv-int8,kv-fp8`) replaces
just their rows of results/eval.json. Every format row (int4 weights and KV among them) is a
valid `moeserve serve` command line for its format, and rows name the commit they ran at."""

from __future__ import annotations

import dataclasses
import subprocess

import httpx
import pytest
import torch

from bench.eval_bench import (
    CHUNKED,
    FORMATS,
    PREFILL_CHUNK,
    merged,
    server_args,
    source_commit,
)
from bench.eval_pack import perplexity_items
from bench.harness import InProcessServer
from service.cli import build_parser
from service.settings import from_namespace

# about 170 of the tiny model's tokens: some 20 chunks of PREFILL_CHUNK
TEXT = perplexity_items()[0]["text"][:400]
BUDGET = "--max-num-batched-tokens"


def scored(model_dir, args: list[str]) -> torch.Tensor:
    """The served prompt logprobs of TEXT (echo, max_tokens 0, as lm-eval asks)."""
    ns = build_parser().parse_args(["serve", "--model", str(model_dir), *args])
    settings = dataclasses.replace(from_namespace(ns), port=0, grpc_port=-1, device="cpu")
    with InProcessServer(settings) as srv:
        body = {
            "model": srv.state.model_name,
            "prompt": TEXT,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
        }
        response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert values[0] is None and len(values) > 8 * PREFILL_CHUNK
    return torch.tensor(values[1:])


def without_budget(args: list[str]) -> list[str]:
    i = args.index(BUDGET)
    return args[:i] + args[i + 2 :]


@pytest.fixture(scope="module")
def bf16(tiny_model_dir) -> dict[str, torch.Tensor]:
    """bf16 cache: prefilled whole, and in the 8-bit rows' chunks."""
    args = server_args("bf16")
    assert BUDGET not in args
    return {
        "whole": scored(tiny_model_dir, args),
        "chunked": scored(tiny_model_dir, [*args, BUDGET, str(PREFILL_CHUNK)]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CHUNKED)
def test_the_8bit_kv_rows_score_through_the_8bit_cache(tiny_model_dir, bf16, fmt):
    args = server_args(fmt)
    assert args[args.index(BUDGET) + 1] == str(PREFILL_CHUNK)
    whole = scored(tiny_model_dir, without_budget(args))
    if fmt == "kv-int4":  # its keys less their mean (key_calibration.py): bf16(k - m) rounds anew
        alone = (whole - bf16["whole"]).abs()  # measured: mean 0.005, at most 0.078
        assert alone.mean().item() < 0.02 and alone.max().item() < 0.25
    else:
        assert torch.equal(whole, bf16["whole"])  # one chunk never reads the cache
    chunked = scored(tiny_model_dir, args)
    moved = (chunked - bf16["chunked"]).abs()
    assert moved.max().item() > 0  # the later chunks read 8-bit keys and values back
    # ...rounded as 8 bits (or int4's 4) round (the random model's logprobs are about -7;
    # int4 moved the tiny models' prompt logprobs 0.04-0.06 on average, at most 0.27, in
    # tests/inference/test_kv_int4.py's chunks of 8)
    mean, most = (0.12, 1.0) if fmt == "kv-int4" else (0.05, 0.5)
    assert moved.mean().item() < mean and moved.max().item() < most


def test_a_partial_run_replaces_its_rows_and_keeps_the_others_in_place():
    def row(model, fmt, ours, date=None):
        return {"model": model, "format": fmt, "task": "t", "metric": "m", "ours": ours} | (
            {"date": date} if date else {}
        )

    record = {"harness": "lm-eval 0.4.13, evalscope 1.14.1", "cpu": "AMD EPYC"}
    previous = record | {
        "harness": "lm-eval 0.4.13",
        "date": "old",
        "rows": [row("a", "bf16", 1), row("a", "kv-int8", 2), row("b", "kv-int8", 3)],
    }
    rows = [row("a", "kv-int8", 20, "new"), row("b", "kv-int8", 30, "new")]
    kept = row("a", "bf16", 1, "old") | {"harness": "lm-eval 0.4.13"}
    assert merged(previous, record, rows) == [kept, *rows]
    # another harness version's or CPU's rows are not mixed in
    assert merged(previous | {"harness": "lm-eval 0.4.12"}, record, rows) == rows
    assert merged(previous | {"cpu": "Intel Xeon"}, record, rows) == rows
    assert merged(None, record, rows) == rows


def test_every_format_row_serves_its_weights_and_cache_format():
    # the formats: bf16, int8, int4 weights and 8- and 4-bit KV, each a valid
    # `moeserve serve` command line that asks for what the row is named after
    want = {
        "bf16": (None, "auto"),
        "int8": ("int8", "auto"),
        "int4": ("int4", "auto"),
        "kv-int8": (None, "int8"),
        "kv-fp8": (None, "fp8_e4m3"),
        "kv-int4": (None, "int4"),
    }
    assert set(FORMATS) == set(want)
    for fmt, (quantization, kv) in want.items():
        ns = build_parser().parse_args(["serve", "--model", "m", *server_args(fmt)])
        settings = from_namespace(ns)
        assert (settings.quantization, settings.kv_cache_dtype) == (quantization, kv), fmt
        assert settings.dtype == "bfloat16"
        chunk = PREFILL_CHUNK if fmt in CHUNKED else None
        assert settings.max_num_batched_tokens == chunk, fmt


def test_rows_name_the_commit_that_served_them():
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    commit = source_commit()
    assert commit.split(" +")[0] == head
    # the uncommitted files named are the served code's (inference/, service/)
    assert all(path.startswith(("inference/", "service/")) for path in commit.split(" +")[1:])
