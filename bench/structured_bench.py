"""`make bench`, structured outputs (issue 18): 32 concurrent requests under a JSON schema
against the same 32 requests unconstrained, output tokens/s as a ratio (target >= 0.9), and
the first request's grammar compile time against a cached request's (a benchmark, not a test).

Model: the `small` demo model in bfloat16 (what the other engine benches use; 32000-token
vocabulary), or `--model smollm2` (the trained SmolLM2-135M-Instruct, 49152 tokens).
Workload: 32 prompts of `--prompt-len` random tokens, sampled at temperature 1 with a seed
per request, constrained by a bounded JSON schema (a random-weight model must end it). The
unconstrained side runs the same prompts with EOS ignored and max_tokens set to the length
each constrained request came out with, so both sides generate the same tokens per request
and their batches thin out alike; the ratio measures what the constraint costs.
Rounds alternate (unconstrained, constrained, constrained, unconstrained...) and the ratio is
the median of the per-round ratios, so drift on a shared VM hits both sides of each pair.

The constrained side runs twice per round, the bitmask filled on the step's path and filled
on a helper thread while the forward pass runs (StructuredOutputManager.overlap), and the
engine's own profile (fill, apply, advance) says where the time went.
Results: bench/results/structured_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import make_prompts
from bench.machine import cpu_name
from bench.structured_backends import SCHEMA  # one schema for both benches
from inference import LLMEngine, SamplingParams, StructuredOutputs
from inference.checkpoints.demo_model import ensure_demo_model
from inference.checkpoints.model_zoo import resolve_model

RESULTS = Path(__file__).parent / "results"


def run(engine: LLMEngine, prompts, params: list[SamplingParams]) -> tuple[float, dict, list]:
    """All requests added at once, stepped to the end: (seconds, outputs by id, step stats)."""
    ids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    started = time.perf_counter()
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    final, steps = {}, []
    while engine.has_unfinished:
        outputs, stats = engine.step()
        steps.append(stats)
        final.update({o.request_id: o for o in outputs if o.finished})
    seconds = time.perf_counter() - started
    return seconds, [final[r] for r in ids], steps


def constrained_params(n: int, max_tokens: int) -> list[SamplingParams]:
    so = StructuredOutputs(json=SCHEMA)
    return [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_outputs=so)
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="small (demo preset) or smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model_dir = ensure_demo_model("small") if args.model == "small" else resolve_model(args.model)
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", dtype="bfloat16", enable_prefix_caching=False
    )
    manager = engine.structured
    prompts = make_prompts(args.requests, args.prompt_len, engine.args.vocab_size)

    # compile times: the first constrained request compiles, the next comes from the cache
    manager._ready.wait()  # the tokenizer view is built at start-up, not part of a compile
    first = engine.generate(prompts[:1], constrained_params(1, args.max_tokens)[0])[0]
    cached = engine.generate(prompts[1:2], constrained_params(1, args.max_tokens)[0])[0]
    compile_first = first.outputs[0].times.grammar_compile_s
    compile_cached = cached.outputs[0].times.grammar_compile_s
    assert first.outputs[0].times.grammar_cache_hit is False
    assert cached.outputs[0].times.grammar_cache_hit is True

    # warm-up: every batch shape both sides use
    _, outs, _ = run(engine, prompts, constrained_params(len(prompts), args.max_tokens))
    lengths = [len(o.token_ids) for o in outs]
    for o in outs:
        assert o.finish_reason == "stop", o.text
        json.loads(o.text)
    free = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    run(engine, prompts, free)

    sides = {"unconstrained": [], "constrained": [], "constrained_overlap": []}
    profiles: dict[str, list[dict]] = {}
    tokens = sum(lengths)
    order = ["unconstrained", "constrained", "constrained_overlap"]
    for r in range(args.rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            manager.overlap = side == "constrained_overlap"
            params = (
                free
                if side == "unconstrained"
                else constrained_params(len(prompts), args.max_tokens)
            )
            before = dict(manager.totals)
            seconds, outs, steps = run(engine, prompts, params)
            got = sum(len(o.token_ids) for o in outs)
            assert got == tokens, (side, got, tokens)  # same tokens, same seeds: same outputs
            sides[side].append(tokens / seconds)
            profiles.setdefault(side, [])
            if side == "unconstrained":
                profiles[side].append({"seconds": seconds, "steps": len(steps)})
            else:
                profile = {k: manager.totals[k] - before[k] for k in before}
                profile["bitmask_s"] = sum(s.bitmask_s for s in steps)
                profile["seconds"] = seconds
                profile["steps"] = len(steps)
                profiles[side].append(profile)
    manager.overlap = False

    def ratio(side: str) -> float:
        return statistics.median(c / u for c, u in zip(sides[side], sides["unconstrained"]))

    def per_step_ms(side: str) -> dict:
        rows = profiles[side]
        steps = sum(p["steps"] for p in rows)
        keys = ("fill", "fill_work", "wait", "apply", "advance", "bitmask_s")
        return {k: round(sum(p[k] for p in rows) / steps * 1e3, 3) for k in keys}

    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": args.model,
        "vocab_size": engine.args.vocab_size,
        "workload": {
            "requests": len(prompts),
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "output_tokens": tokens,
            "output_tokens_per_request_mean": round(tokens / len(prompts), 1),
            "rounds": args.rounds,
        },
        "schema": SCHEMA,
        "compile_first_ms": round(compile_first * 1e3, 3),
        "compile_cached_ms": round(compile_cached * 1e3, 4),
        "tokens_per_s": {k: round(statistics.median(v), 1) for k, v in sides.items()},
        "ratio": round(ratio("constrained"), 3),
        "ratio_overlap": round(ratio("constrained_overlap"), 3),
        "per_step_ms": {side: per_step_ms(side) for side in sides if side != "unconstrained"},
        "step_ms_mean": {
            side: round(sum(p["seconds"] for p in rows) / sum(p["steps"] for p in rows) * 1e3, 2)
            for side, rows in profiles.items()
        },
    }
    # the engine's own accounting, steadier than throughput on a shared VM: the share of the
    # constrained steps' time that went to masks (fill, apply, advance) on the step's path
    results["bitmask_share_of_step"] = {
        side: round(results["per_step_ms"][side]["bitmask_s"] / results["step_ms_mean"][side], 4)
        for side in results["per_step_ms"]
    }
    print(json.dumps(results, indent=2))
    print(
        f"structured outputs: constrained/unconstrained output tokens/s = {results['ratio']} "
        f"(overlapped fill: {results['ratio_overlap']}; target >= 0.9); masks took "
        f"{results['bitmask_share_of_step']['constrained']:.1%} of a constrained step; grammar compile "
        f"first {results['compile_first_ms']} ms, cached {results['compile_cached_ms']} ms"
    )
    RESULTS.mkdir(exist_ok=True)
    name = (
        "structured_bench.json" if args.model == "small" else f"structured_bench_{args.model}.json"
    )
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
