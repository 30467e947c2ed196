"""`make bench`: offline engine throughput against Hugging Face transformers on the same
model and prompts, in the same run, printed as ratios (a benchmark, not a test).

Workload (issue 2): the `small` demo model in bfloat16, 32 requests of 128 prompt tokens and
128 greedy output tokens (EOS ignored); plus a single stream of 1 request, 128 -> 128.
Baselines: transformers `generate` one request at a time, and static batches of 16 with
left padding. The sequential baseline runs a subset of the requests (its per-request cost
is constant, so tokens/s is unaffected) to keep the run short.

`--arch A` (repeatable, or `--arch all`) instead prints one row per architecture: the engine
against transformers `generate` (static batches of 16) on that architecture's demo model of
`--preset` size, with the --requests/--prompt-len/--output-len workload.

`--smollm2` instead prints the SmolLM2 rows: the trained SmolLM2-135M-Instruct (`--model
smollm2`, a dense Llama; fetched and imported on first use) in bfloat16, engine against
transformers `generate` on the same --requests/--prompt-len/--output-len workload, single
stream and batched (static batches of 16).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ARCHS, ensure_demo_model

RESULTS = Path(__file__).parent / "results"


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def hf_generate(model, batch: list[list[int]], new_tokens: int, **options) -> int:
    """Left-padded static batch on the model's device; returns generated tokens. `options` go
    to `generate` (bench/gpu_bench.py caps the time with max_time)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **options,
    )
    return (out.shape[1] - width) * len(batch)


def hf_static_batches(
    model, prompts: list[list[int]], new_tokens: int, size: int = 16, **options
) -> int:
    """transformers `generate` over static batches of `size`; returns generated tokens."""
    return sum(
        hf_generate(model, prompts[i : i + size], new_tokens, **options)
        for i in range(0, len(prompts), size)
    )


def engine_tokens(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> int:
    """Generates `batch`, checks each request got all params.max_tokens tokens; returns them."""
    outs = engine.generate(batch, params)
    assert all(len(o.token_ids) == params.max_tokens for o in outs)
    return len(batch) * params.max_tokens


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def best_rate(fn, rounds: int) -> float:
    """Best tokens/s of `rounds` runs of fn() (which returns the tokens it generated): on a
    shared VM the best run is the one least disturbed by neighbours, for either side."""
    rates = []
    for _ in range(rounds):
        seconds, tokens = timed(fn)
        rates.append(tokens / seconds)
    return max(rates)


def load_engine(model_dir: Path, compile: bool = False) -> LLMEngine:
    # No prefix caching: transformers has none, and the rounds reuse the same prompts.
    return LLMEngine.from_pretrained(
        model_dir, device="cpu", dtype="bfloat16", enable_prefix_caching=False, compile=compile
    )


def warm_up(engines: list[LLMEngine], hf, prompts: list[list[int]]) -> None:
    """Every shape the measurements use, briefly, on both sides: oneDNN builds its kernels per
    shape on first use, which would otherwise be timed."""
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for engine in engines:
        engine.generate(prompts, short)
        engine.generate(prompts[:1], short)
    with torch.inference_mode():
        hf_generate(hf, prompts[:16], 4)
        hf_generate(hf, prompts[:1], 4)


def bench_offline(
    model_dir: Path,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    sequential_subset: int,
    rounds: int,
) -> dict:
    from transformers import AutoModelForCausalLM

    engines = {
        "moeserve": load_engine(model_dir),
        "moeserve_compiled": load_engine(model_dir, compile=True),
    }
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = make_prompts(num_requests, prompt_len, engines["moeserve"].args.vocab_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warm_up(list(engines.values()), hf, prompts)
    rows = {}
    for name, engine in engines.items():
        rows[f"{name}_batched"] = best_rate(
            lambda e=engine: engine_tokens(e, prompts, params), rounds
        )
        rows[f"{name}_single_stream"] = best_rate(
            lambda e=engine: engine_tokens(e, prompts[:1], params), rounds
        )
    with torch.inference_mode():
        rows["hf_sequential"] = best_rate(
            lambda: sum(hf_generate(hf, [p], output_len) for p in prompts[:sequential_subset]), 1
        )
        rows["hf_static_batch16"] = best_rate(
            lambda: hf_static_batches(hf, prompts, output_len), rounds
        )
        rows["hf_single_stream"] = best_rate(
            lambda: hf_generate(hf, prompts[:1], output_len), rounds
        )
    return rows


def bench_arch(
    arch: str, preset: str, num_requests: int, prompt_len: int, output_len: int, rounds: int
) -> dict:
    """Engine (continuous batching) vs transformers static batches of 16, bfloat16, one arch."""
    from transformers import AutoModelForCausalLM

    model_dir = ensure_demo_model(preset, arch=arch)
    engine = load_engine(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = make_prompts(num_requests, prompt_len, engine.args.vocab_size)
    params = SamplingParams(
        max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True
    )
    warm_up([engine], hf, prompts)
    row = {"moeserve_batched": best_rate(lambda: engine_tokens(engine, prompts, params), rounds)}
    with torch.inference_mode():
        row["hf_static_batch16"] = best_rate(
            lambda: hf_static_batches(hf, prompts, output_len), rounds
        )
    row["ratio"] = row["moeserve_batched"] / row["hf_static_batch16"]
    return row


def bench_smollm2(num_requests: int, prompt_len: int, output_len: int, rounds: int) -> dict:
    """SmolLM2-135M-Instruct, bf16: single stream and batched, engine vs transformers."""
    from transformers import AutoModelForCausalLM

    from inference.checkpoints.model_zoo import resolve_model

    model_dir = resolve_model("smollm2")
    engine = load_engine(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = make_prompts(num_requests, prompt_len, engine.args.vocab_size)
    params = SamplingParams(
        max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True
    )
    warm_up([engine], hf, prompts)
    row = {
        "moeserve_single_stream": best_rate(
            lambda: engine_tokens(engine, prompts[:1], params), rounds
        ),
        "moeserve_batched": best_rate(lambda: engine_tokens(engine, prompts, params), rounds),
    }
    with torch.inference_mode():
        row["hf_single_stream"] = best_rate(
            lambda: hf_generate(hf, prompts[:1], output_len), rounds
        )
        row["hf_static_batch16"] = best_rate(
            lambda: hf_static_batches(hf, prompts, output_len), rounds
        )
    row["single_ratio"] = row["moeserve_single_stream"] / row["hf_single_stream"]
    row["batched_ratio"] = row["moeserve_batched"] / row["hf_static_batch16"]
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    [answer] = engine.generate([chat], SamplingParams(max_tokens=16, temperature=0.0))
    row["answer"] = answer.text  # a trained model: a sensible answer, not noise
    return row


def main_smollm2(num_requests: int, prompt_len: int, output_len: int, rounds: int) -> None:
    r = bench_smollm2(num_requests, prompt_len, output_len, rounds)
    print(
        f"\nSmolLM2-135M-Instruct, bf16, {num_requests} requests x {prompt_len} -> {output_len} tokens, "
        f"{torch.get_num_threads()} threads (output tok/s)"
    )
    print(f"  {'':14s} {'moeserve':>9s} {'hf':>9s} {'ratio':>6s}")
    print(
        f"  {'single stream':14s} {r['moeserve_single_stream']:9.1f} {r['hf_single_stream']:9.1f} "
        f"{r['single_ratio']:5.2f}x"
    )
    print(
        f"  {'batched':14s} {r['moeserve_batched']:9.1f} {r['hf_static_batch16']:9.1f} "
        f"{r['batched_ratio']:5.2f}x   (hf: static batches of 16)"
    )
    print(f"  greedy answer to 'What is the capital of France?': {r['answer']!r}")
    RESULTS.mkdir(exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": "smollm2",
        "requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "smollm2": r,
    }
    (RESULTS / "engine_bench_smollm2.json").write_text(json.dumps(record, indent=2))


def main_archs(
    archs: list[str], preset: str, num_requests: int, prompt_len: int, output_len: int, rounds: int
) -> None:
    archs = sorted(ARCHS) if "all" in archs else archs
    unknown = set(archs) - set(ARCHS)
    if unknown:
        raise SystemExit(f"unknown arch(s) {sorted(unknown)}; choose from {sorted(ARCHS)} or all")
    print(
        f"\n{preset} demo models, bf16, {num_requests} requests x {prompt_len} -> {output_len} tokens, "
        f"{torch.get_num_threads()} threads (output tok/s)"
    )
    print(f"  {'arch':12s} {'moeserve':>9s} {'hf_batch16':>10s} {'ratio':>6s}")
    rows = {}
    for arch in archs:
        rows[arch] = r = bench_arch(arch, preset, num_requests, prompt_len, output_len, rounds)
        print(
            f"  {arch:12s} {r['moeserve_batched']:9.1f} {r['hf_static_batch16']:10.1f} {r['ratio']:5.2f}x"
        )
    RESULTS.mkdir(exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "preset": preset,
        "requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "archs": rows,
    }
    (RESULTS / f"engine_bench_archs_{preset}.json").write_text(json.dumps(record, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sequential-subset", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per row; the best counts")
    parser.add_argument(
        "--arch",
        action="append",
        default=[],
        help=f"per-architecture rows instead ({', '.join(sorted(ARCHS))} or all)",
    )
    parser.add_argument("--preset", default="small", help="demo model size for --arch rows")
    parser.add_argument(
        "--smollm2",
        action="store_true",
        help="SmolLM2-135M-Instruct rows instead (engine vs transformers)",
    )
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if args.smollm2:
        main_smollm2(args.requests, args.prompt_len, args.output_len, args.rounds)
        return
    if args.arch:
        main_archs(
            args.arch, args.preset, args.requests, args.prompt_len, args.output_len, args.rounds
        )
        return
    model_dir = ensure_demo_model("small")
    rows = bench_offline(
        model_dir,
        args.requests,
        args.prompt_len,
        args.output_len,
        args.sequential_subset,
        args.rounds,
    )
    ratios = {}
    for name in ("moeserve", "moeserve_compiled"):
        ratios.update(
            {
                f"{name} batched / hf_sequential (target >= 10)": rows[f"{name}_batched"]
                / rows["hf_sequential"],
                f"{name} batched / hf_static_batch16 (target >= 2)": rows[f"{name}_batched"]
                / rows["hf_static_batch16"],
                f"{name} single / hf_single (target >= 2.5)": rows[f"{name}_single_stream"]
                / rows["hf_single_stream"],
            }
        )
    print(
        f"\nsmall demo model, bf16, {args.requests} requests x {args.prompt_len} -> {args.output_len} tokens, "
        f"{torch.get_num_threads()} threads, best of {args.rounds} rounds (hf_sequential: 1)"
    )
    for name, value in rows.items():
        print(f"  {name:34s} {value:9.1f} output tok/s")
    for name, value in ratios.items():
        print(f"  {name:63s} {value:6.2f}x")
    RESULTS.mkdir(exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "tokens_per_s": rows,
        "ratios": ratios,
    }
    (RESULTS / "engine_bench.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
