"""`make bench`: each family's decode speed on its `small` demo preset (the family's own shape:
DeepSeek-V3 routing 8 of 256 experts, gpt-oss's sinks and windows...), bf16 and int8, against
this CPU's floor, in the same run (a benchmark, not a test).

The floor of a decode token is the bytes a lone sequence must read for it (every weight once,
of each MoE layer only its top-k experts, one embedding row, its KV context) over the rate
this machine reads memory (read_rate, with the engine's threads, the best of the row's
rounds). `share` = floor time / measured step time: 1.0 is the memory bound. `vs mixtral`:
the bytes per second the family's decode reaches over Mixtral's, in alternating rounds (the
issue's bar: >= 0.7x). Single stream: the median
of 64 decode steps after a 128-token prompt; batched: 16 requests of 128 -> 64 tokens; each
the best of --rounds runs.
Results in bench/results/family_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import cpu_name
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ARCHS, ensure_demo_model
from inference.executor.kv_cache import kv_bytes_per_token
from inference.kernels import cpu
from inference.models.moe import MoE
from inference.quantization.qweight import QWeight

RESULTS = Path(__file__).parent / "results"
PROMPT, STEPS, BATCH = 128, 64, 16


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, QWeight) else w.numel() * w.element_size()


def token_bytes(engine: LLMEngine, context: float) -> float:
    """The bytes one decode token of a lone sequence reads at least (module docstring)."""
    model = engine.executor.model
    total = float(engine.weight_bytes)
    for m in model.modules():
        if isinstance(m, MoE):
            experts = _nbytes(m.experts.w13) + _nbytes(m.experts.w2)
            total -= experts * (1 - m.top_k / m.num_experts)
    embed = getattr(model.embed, "plain", model.embed).weight
    total -= _nbytes(embed) * (1 - 1 / engine.args.vocab_size)
    return total + kv_bytes_per_token(engine.args, engine.executor.kv_storage) * context


def _best_seconds(fn, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_rate() -> float:
    """Bytes per second this machine reads: the faster of a float32 sum over 512 MB and our
    kernels' one-row product with a 256 MB bf16 weight (the read a decode step makes), best
    of 5 each."""
    x = torch.ones(128 * 2**20)
    rate = x.numel() * 4 / _best_seconds(x.sum)
    del x
    if cpu.enable_once() is not None:
        w = cpu.pack_weight(torch.ones(32768, 4096, dtype=torch.bfloat16))
        row = torch.ones(1, 4096, dtype=torch.bfloat16)
        rate = max(rate, w.numel() * 2 / _best_seconds(lambda: cpu.linear(row, w)))
    return rate


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(n)]


def single_stream_step(engine: LLMEngine) -> float:
    """The median decode step of a lone sequence (each step ends reading its token back)."""
    engine.add_request("single", prompts(1, engine.args.vocab_size, 1)[0], greedy(STEPS + 1))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batched_rate(engine: LLMEngine) -> float:
    batch = prompts(BATCH, engine.args.vocab_size, 2)
    start = time.perf_counter()
    outs = engine.generate(batch, greedy(STEPS))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def load(arch: str, quantization: str) -> LLMEngine:
    engine = LLMEngine.from_pretrained(
        ensure_demo_model("small", arch=arch),
        device="cpu",
        dtype="bfloat16",
        quantization=None if quantization == "bf16" else quantization,
        enable_prefix_caching=False,
    )
    engine.generate(prompts(2, engine.args.vocab_size, 9), greedy(4))  # every shape once
    return engine


def bench(engine: LLMEngine, mixtral: LLMEngine, rounds: int) -> dict:
    """One family's row. This VM's memory rate drifts by tens of percent within a minute, so
    the family and Mixtral run in alternating rounds (best of each), and `vs_mixtral` compares
    the bytes per second each reached in them (the read rate cancels out)."""
    steps, mixtral_steps, rates = [], [], []
    for _ in range(rounds):
        rates.append(read_rate())
        mixtral_steps.append(single_stream_step(mixtral))
        steps.append(single_stream_step(engine))
    step, mixtral_step, rate = min(steps), min(mixtral_steps), max(rates)
    context = PROMPT + STEPS / 2
    nbytes, mixtral_bytes = token_bytes(engine, context), token_bytes(mixtral, context)
    return {
        "single_tok_s": 1 / step,
        "batched_tok_s": max(batched_rate(engine) for _ in range(rounds)),
        "token_mb": nbytes / 1e6,
        "read_gb_s": rate / 1e9,
        "floor_tok_s": rate / nbytes,
        "share": nbytes / rate / step,
        "vs_mixtral": (nbytes / step) / (mixtral_bytes / mixtral_step),
        "fused_step": engine.executor.fused_step is not None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", action="append", help="families (default: every one)")
    parser.add_argument("--formats", default="bf16,int8")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many runs each")
    args = parser.parse_args()
    archs = args.arch or sorted(ARCHS)
    print(f"family decode on the small presets, {cpu_name()}, {torch.get_num_threads()} threads")
    print(
        f"  {'arch':12s} {'fmt':5s} {'MB/tok':>7s} {'GB/s':>5s} {'single':>7s} {'floor':>7s}"
        f" {'share':>6s} {'vs mixtral':>10s} {'batched':>8s}"
    )
    rows: dict[str, dict] = {}
    for fmt in args.formats.split(","):
        mixtral = load("mixtral", fmt)
        for arch in ["mixtral", *[a for a in archs if a != "mixtral"]]:
            engine = mixtral if arch == "mixtral" else load(arch, fmt)
            rows[f"{arch}/{fmt}"] = r = bench(engine, mixtral, args.rounds)
            del engine
            print(
                f"  {arch:12s} {fmt:5s} {r['token_mb']:7.1f} {r['read_gb_s']:5.1f}"
                f" {r['single_tok_s']:7.1f} {r['floor_tok_s']:7.1f} {r['share']:6.2f}"
                f" {r['vs_mixtral']:9.2f}x {r['batched_tok_s']:8.1f}"
            )
        del mixtral
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "family_bench.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
