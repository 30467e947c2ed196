"""`make bench`: one user's latency at long contexts (issue 38), a benchmark, not a test.

- TTFT and TPOT of a lone request whose prompt fills 1K, 4K, 8K and 32K tokens of context
  (32K: 32,768 less the output), greedy, EOS ignored, on the small demo MoE and on SmolLM2
  (bf16 both; SmolLM2 ships 8,192 positions and serves 32K with vLLM's recipe,
  --hf-overrides YaRN x4). TTFT: from add_request to the step that emits the first token
  (the prompt prefilled in chunks of --max-num-batched-tokens); TPOT: the median of the
  decode steps after it. Prefix caching off, a fresh random prompt per run, a short request
  first to warm the shapes up; the best of --rounds runs, each round running every context
  once (`tpot_vs_shortest_by_round`: each round's ratios, runs a minute apart, which a host
  whose speed drifts moves far less than the bests taken minutes apart). The issue's bar:
  TPOT at 32K <= 1.5x TPOT at 1K (`tpot_vs_shortest`: against the shortest context run, 1K
  by default).
  `bytes_floor_vs_shortest`: the same ratio of the bytes a step must read (the weights a token
  reads, bench/decode_floor.py, plus the KV cache of its context): where KV bytes outgrow the
  weights' the TPOT ratio cannot fall below it however fast the kernels (on the demo MoE with
  bf16 KV, 2.2x at 32K against 1K; --kv-cache-dtype int8 1.6x, int4 1.35x).
- The decode-attention kernel alone (kernels/csrc/attention.c, reading the paged cache in
  place): nanoseconds per context position of one query token from 1K to 32K positions, in
  each model's attention shape; flat when it streams the cache at one rate (`vs_shortest`).
  Each call reads the next of several layers' caches, as a decode step does (up to the
  model's layers, CACHE_BUDGET in all): one layer's cache alone fits the last-level cache
  (16.8 MB at 32K on the demo), which a step's six layers (100 MB) do not.

Results in bench/results/long_context.json {date, cpu, threads, rows: [{model, context,
prompt, kv_cache_dtype, ttft_s, tpot_ms, tpot_vs_shortest, tpot_ms_by_round,
tpot_vs_shortest_by_round, bytes_floor_vs_shortest}],
decode_attention: [{shape, context, kv_cache_dtype, layers_read, ns_per_position, vs_shortest}]}; a table on
stdout.

    python -m bench.long_context_bench                                  # the timed run
    python -m bench.long_context_bench --models demo --kv-cache-dtype int4   # int4 KV
    python -m bench.long_context_bench --contexts 256,512 --output 4 --out /tmp/lc.json  # a check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.decode_floor import engine_weight_bytes_per_token
from bench.machine import cpu_name
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ensure_demo_model
from inference.checkpoints.model_zoo import resolve_model
from inference.kernels import cpu
from inference.models import paged_cache

RESULTS = Path(__file__).parent / "results"
CONTEXTS = (1024, 4096, 8192, 32768)
OUTPUT = 32  # tokens each request generates: the first for TTFT, the rest for TPOT
# SmolLM2's 8,192 positions stretched to 32,768 as vLLM's YaRN recipe does
SMOLLM2_YARN = {
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
}
# query heads, kv heads, head dim and layers of each model's attention (decode-attention rows)
SHAPES = {"demo": (8, 2, 64, 6), "smollm2": (9, 3, 64, 30)}
CACHE_BUDGET = 256 << 20  # bytes of caches the kernel rows cycle through, at most


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)


def load(model: str, longest: int, kv_cache_dtype: str = "auto") -> LLMEngine:
    """The model in bf16 with room for one request of `longest` tokens."""
    overrides = SMOLLM2_YARN if model == "smollm2" else None
    path = resolve_model("smollm2") if model == "smollm2" else ensure_demo_model("small")
    return LLMEngine.from_pretrained(
        path,
        device="cpu",
        dtype="bfloat16",
        hf_overrides=overrides,
        max_model_len=longest,
        kv_cache_tokens=longest + 64,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )


def prompt_len(context: int, output: int) -> int:
    """The prompt filling `context` positions, less the output past 32K (the models' limit)."""
    return min(context, CONTEXTS[-1] - output)


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def latency(engine: LLMEngine, prompt: list[int], output: int) -> tuple[float, float]:
    """(TTFT seconds, median TPOT seconds) of one request alone in the engine."""
    engine.add_request("long", prompt, greedy(output))
    start = time.perf_counter()
    ttft = None
    while ttft is None:
        outs, _ = engine.step()
        if any(o.request_id == "long" and o.token_ids for o in outs):
            ttft = time.perf_counter() - start
    steps = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return ttft, statistics.median(steps) if steps else float("nan")


def model_rows(
    model: str, contexts: list[int], output: int, rounds: int, kv_cache_dtype: str = "auto"
) -> list[dict]:
    engine = load(model, max(prompt_len(c, output) for c in contexts) + output, kv_cache_dtype)
    vocab = engine.args.vocab_size
    weights = engine_weight_bytes_per_token(engine)
    kv_per_token = engine.executor.kv_cache_bytes / engine.executor.kv_cache_tokens

    def step_bytes(length: int) -> float:  # a decode step's reads at the run's mean context
        return weights + kv_per_token * (length + output / 2)

    engine.generate([prompt_of(64, vocab, 99)], greedy(8))  # every shape once
    lengths = [prompt_len(c, output) for c in contexts]
    # A round runs every context once, so a host whose speed drifts from minute to minute
    # moves a round's contexts alike: each round's TPOT ratios pair runs a minute apart.
    runs: list[list[tuple[float, float]]] = [[] for _ in contexts]
    for seed in range(rounds):
        for i, length in enumerate(lengths):
            runs[i].append(latency(engine, prompt_of(length, vocab, seed), output))
    rows = []
    for context, length, done in zip(contexts, lengths, runs, strict=True):
        ttft, tpot = min(r[0] for r in done), min(r[1] for r in done)
        by_round = [r[1] / first[1] for r, first in zip(done, runs[0], strict=True)]
        rows.append(
            {
                "model": model,
                "context": context,
                "prompt": length,
                "kv_cache_dtype": kv_cache_dtype,
                "ttft_s": ttft,
                "tpot_ms": tpot * 1e3,
                "tpot_vs_shortest": tpot * 1e3 / (rows[0]["tpot_ms"] if rows else tpot * 1e3),
                "tpot_ms_by_round": [r[1] * 1e3 for r in done],
                "tpot_vs_shortest_by_round": by_round,
                "bytes_floor_vs_shortest": step_bytes(length) / step_bytes(lengths[0]),
            }
        )
        r = rows[-1]
        print(
            f"  {model:8s} {context:>7,} {ttft:9.3f} s {r['tpot_ms']:9.2f} ms"
            f" {r['tpot_vs_shortest']:6.2f}x (bytes floor {r['bytes_floor_vs_shortest']:.2f}x;"
            f" by round {', '.join(f'{x:.2f}x' for x in by_round)})",
            flush=True,
        )
    return rows


def cache_of(slots: int, kv_heads: int, dim: int, storage: torch.dtype) -> torch.Tensor:
    """A cache of random rows in the storage format (quantized as the engine writes them)."""
    rows = torch.randn(slots, kv_heads, dim).bfloat16()
    if storage == torch.bfloat16:
        return rows
    width = paged_cache.row_width(dim, storage)
    cache = torch.zeros(slots, kv_heads, width, dtype=torch.uint8).view(storage)
    paged_cache.write_kv(cache, torch.arange(slots), rows)
    return cache


def decode_attention_rows(
    contexts: list[int], kv_cache_dtype: str = "auto", calls: int = 50
) -> list[dict]:
    """ns per position of the decode-attention kernel, one query token over a paged context
    in the cache format `kv_cache_dtype` (auto: bf16) scattered over the cache's blocks (a
    shuffled block table), median of `calls`, each call on the next of the model's layers'
    caches (as many as CACHE_BUDGET holds)."""
    if cpu.enable_once() is None:
        print("  decode attention: no CPU kernels on this machine (ATen's path); skipped")
        return []
    storage = paged_cache.storage_dtype(kv_cache_dtype, torch.bfloat16)
    rows, block = [], 16
    for shape, (heads, kv_heads, dim, layers) in SHAPES.items():
        longest = max(contexts)
        blocks = longest // block + 1
        width = paged_cache.row_width(dim, storage)
        layer_bytes = 2 * blocks * block * kv_heads * width * storage.itemsize
        caches = [
            tuple(cache_of(blocks * block, kv_heads, dim, storage) for _ in "kv")
            for _ in range(max(1, min(layers, CACHE_BUDGET // layer_bytes)))
        ]
        table = torch.randperm(blocks, dtype=torch.int32)[None]
        q = torch.randn(1, heads, dim).bfloat16()
        base = None
        for context in contexts:
            lens = torch.tensor([context], dtype=torch.int32)
            times = []
            for i in range(calls):
                k_cache, v_cache = caches[i % len(caches)]
                t0 = time.perf_counter()
                cpu.decode_attention(q, k_cache, v_cache, table, lens, block, dim**-0.5)
                times.append(time.perf_counter() - t0)
            ns = statistics.median(times) / context * 1e9
            base = base or ns
            rows.append(
                {
                    "shape": shape,
                    "context": context,
                    "kv_cache_dtype": kv_cache_dtype,
                    "layers_read": len(caches),
                    "ns_per_position": ns,
                    "vs_shortest": ns / base,
                }
            )
            print(f"  {shape:8s} {context:>7,} {ns:9.2f} ns/position {ns / base:6.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,smollm2")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--output", type=int, default=OUTPUT, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="best of this many runs each")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), int8, int4, ...")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = parser.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(","))
    print(f"long contexts, {cpu_name()}, {torch.get_num_threads()} threads")
    print(f"  {'model':8s} {'context':>7s} {'TTFT':>11s} {'TPOT':>12s} {'vs 1st':>7s}")
    rows = []
    for model in args.models.split(","):
        rows += model_rows(model, contexts, args.output, args.rounds, args.kv_cache_dtype)
    print(f"  decode attention alone, one query token, {args.kv_cache_dtype} cache:")
    attention = decode_attention_rows(contexts, args.kv_cache_dtype)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "output": args.output,
        "rows": rows,
        "decode_attention": attention,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
