"""`make bench`: 8-bit weights and KV cache (issue 19), accuracy and speed, each as a ratio
against bf16 measured in the same run (a benchmark, not a test).

Accuracy (`--accuracy`): perplexity of SmolLM2-135M-Instruct (the trained model `--model
smollm2` serves) on a fixed English text every machine has, CPython's own
`pydoc_data/topics.py` (the stdlib's documentation topics): its first 32,768 tokens in 32
windows of 1,024 scored tokens, each window scored through the engine's prompt_logprobs.
The windows are lm-eval's loglikelihood_rolling ones (`rolling_windows`): each scores its
tokens after one token of context (the one before it; the BOS, or EOS, for the first), so
lm-eval's rolling perplexity over the same text, with its `hf` model at max_length 1,024 or
its `local-completions` at 1,026 (LM_EVAL_MAX_LENGTH), is the same number
(tests/service/test_lm_eval.py checks that through the API). Windows are prefilled in chunks
of 64 tokens, so every chunk after a window's first attends over the KV cache as stored
(quantized, for the 8-bit caches). Configurations: bf16; int8, fp8 and int4 weights (int4
also unrotated, all 4-bit, in groups of 32, with every layer's sensitive projections int8 and
with Q4_0's symmetric levels: what each of
int4's choices buys it); int8, fp8_e4m3 and fp8_e5m2 KV caches. Each gets its relative perplexity increase
over bf16 and its greedy agreement with bf16 over 16 prompts x 128 tokens (prompts: 16 runs
of 64 tokens from later in the same text; agreement: the share of tokens generated before
the first difference, and how many of the 16 are identical); and the issue-40 measure the
llama.cpp rows share (bench/peers/llama_accuracy.py): greedy continuations of PASSAGES passages
of PASSAGE_PROMPT tokens from a part of the text neither of the above reads (`passages`),
PASSAGE_TOKENS tokens each, as the mean count of tokens before the first difference from bf16
(`passage_agreement`). int8_weights_kv is our W8A8 as served (int8 weights and KV cache);
the `_act32` rows the same with an activation scale per 32 inputs instead of one a token
(MOESERVE_INT8_ACT_GROUP=32, llama.cpp Q8_0's blocks; issue 40).

Speed (`--speed`): a demo model (`--preset`: small, as `make bench`'s engine rows, or medium,
whose weights are many times the last-level cache), int8, fp8 and int4 weights against bf16,
single stream 128 -> 128 and batched 32 x 128 -> 128 (prefill included: new prompts each
round), rounds alternating between the engines (best of each); resident weight bytes; single
stream as a share of the floor, bytes a token must read / memory bandwidth measured in the same
run (bench/decode_floor.py); and KV capacity: the tokens each cache format holds in the same
byte budget, from the engines' own numbers. `--speed-configs` runs only some of the engines
(bf16 always, for the ratios; results under "speed_<names>"), e.g. `--speed-configs int8
int8_act32`: int8 with one activation scale a token against one per 32 inputs, alternating
in the same run.

llama.cpp's rows (`--llamacpp`, bench/peers/llama_accuracy.py): the same perplexity and passage
agreement for SmolLM2 as a bf16 GGUF and llama.cpp's own Q8_0, Q4_0 and Q4_K_M, against its
bf16 GGUF, under "llamacpp_accuracy".

Results: bench/results/quant_bench.json (with the CPU's name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from bench.engine_bench import make_prompts
from bench.machine import cpu_name
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"
WINDOW, TOKENS, CHUNK = 1024, 32768, 64  # WINDOW: the tokens each window scores
PROMPTS, PROMPT_LEN = 16, 64  # the 16 x 128 greedy agreement's prompts, after the scored text
# the greedy-agreement passages (issue 40): read after the text the two measures above read
PASSAGES, PASSAGE_PROMPT, PASSAGE_TOKENS = 8, 64, 48
# the lm-eval max_length giving the same windows: local-completions keeps one token of it for
# generation and one for context, the hf model one for context beyond it
LM_EVAL_MAX_LENGTH = {"hf": WINDOW, "local-completions": WINDOW + 2}
ACCURACY_CONFIGS = {
    "bf16": {},
    "int8_weights": {"quantization": "int8"},
    "fp8_weights": {"quantization": "fp8"},
    # int4 as served: groups of 128, the Q4_K search, rotated, every layer's sensitive
    # projections int8 (inference/executor/quantize.py's Int4Choices); then one choice changed a
    # row, by its switch
    "int4_weights": {"quantization": "int4"},
    "int4_unrotated_weights": {"quantization": "int4", "env": {"MOESERVE_INT4_ROTATE": "0"}},
    "int4_all_4bit_weights": {"quantization": "int4", "env": {"MOESERVE_INT4_WIDE": "0"}},
    "int4_group32_weights": {"quantization": "int4", "env": {"MOESERVE_INT4_GROUP": "32"}},
    # only Q4_K_M's use_more_bits layers' (the default before 2026-12-06)
    "int4_wide_layers_weights": {"quantization": "int4", "env": {"MOESERVE_INT4_WIDE": "1"}},
    # the first pass's Q4_0 levels (symmetric, every projection 4-bit), for comparison
    "int4_symmetric_weights": {
        "quantization": "int4",
        "env": {"MOESERVE_INT4_METHOD": "symmetric", "MOESERVE_INT4_WIDE": "0"},
    },
    "int8_kv": {"kv_cache_dtype": "int8"},
    "int8_weights_kv": {"quantization": "int8", "kv_cache_dtype": "int8"},  # W8A8 as served
    # the same with an activation scale per 32 inputs (llama.cpp Q8_0's blocks; issue 40)
    "int8_weights_act32": {"quantization": "int8", "int8_act_group": 32},
    "int8_weights_kv_act32": {
        "quantization": "int8",
        "kv_cache_dtype": "int8",
        "int8_act_group": 32,
    },
    "fp8_e4m3_kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2_kv": {"kv_cache_dtype": "fp8_e5m2"},
    # two values a byte, a scale per 32 (models/paged_cache.py), read back by each later chunk
    # (keys less their mean at load: inference/executor/key_calibration.py), and without either
    "int4_kv": {"kv_cache_dtype": "int4"},
    "int4_kv_unshifted": {"kv_cache_dtype": "int4", "env": {"MOESERVE_KV_KEY_SHIFT": "0"}},
    "int4_kv_plain_rounding": {"kv_cache_dtype": "int4", "env": {"MOESERVE_KV_KEY_ROUNDING": "0"}},
    "int4_kv_uncalibrated": {
        "kv_cache_dtype": "int4",
        "env": {"MOESERVE_KV_KEY_SHIFT": "0", "MOESERVE_KV_KEY_ROUNDING": "0"},
    },
}


SPEED_CONFIGS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "int4": {"quantization": "int4"},
    # int8 with an activation scale per 32 inputs (MOESERVE_INT8_ACT_GROUP=32); not by default
    "int8_act32": {"quantization": "int8", "int8_act_group": 32},
}
DEFAULT_SPEED = ("bf16", "int8", "fp8", "int4")


@contextlib.contextmanager
def int8_act_group(group: int | None) -> Iterator[None]:
    """int8 activation scales per `group` inputs for the block (None: as configured), then
    restored: a process-wide setting the kernels read at each call, so engines differing only in
    it can alternate in one run."""
    from inference.kernels import cpu as cpu_kernels
    from inference.quantization import qweight as quant

    before = quant.INT8_ACT_GROUP
    if group is not None:
        cpu_kernels.int8_act_group(group)
    try:
        yield
    finally:
        cpu_kernels.int8_act_group(before)


def corpus_ids(tokenizer) -> list[int]:
    import pydoc_data.topics

    text = Path(pydoc_data.topics.__file__).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < TOKENS + PROMPTS * PROMPT_LEN + PASSAGES * PASSAGE_PROMPT:
        raise RuntimeError(f"pydoc_data/topics.py gives only {len(ids)} tokens")
    return ids


def prefix_token(tokenizer) -> int:
    """What the first window's first token is scored after: lm-eval's prefix_token_id for a
    Hugging Face tokenizer (its BOS, or its EOS where it has none)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def rolling_windows(
    ids: list[int], prefix: int, scored: int = WINDOW
) -> list[tuple[list[int], list[int]]]:
    """lm-eval's loglikelihood_rolling windows (get_rolling_token_windows with context_len 1,
    made disjoint): (context, tokens scored after it), every token scored once, `scored` to a
    window. The first window's context is `prefix`, a full window's the one token before it;
    a last, shorter one is read after as many earlier tokens as fill a full window's length."""
    windows = []
    for start in range(0, len(ids), scored):
        end = min(start + scored, len(ids))
        context = [prefix] if start == 0 else ids[end - scored - 1 : start]
        windows.append((context, ids[start:end]))
    return windows


def perplexity(engine: LLMEngine, ids: list[int], prefix: int, scored: int = WINDOW) -> float:
    """Per-token perplexity of ids over rolling_windows(ids, prefix, scored)."""
    windows = rolling_windows(ids, prefix, scored)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = engine.generate([context + tokens for context, tokens in windows], params)
    nll = 0.0
    for (context, _), out in zip(windows, outs, strict=True):
        nll -= sum(lp.logprob for lp in out.prompt_logprobs[len(context) :])
    return math.exp(nll / len(ids))


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int = 128) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def passages(ids: list[int]) -> list[list[int]]:
    """The greedy-agreement passages: PASSAGES prompts of PASSAGE_PROMPT tokens, spread evenly
    over the text after the perplexity windows and the 16 agreement prompts (so no passage is
    text another measure reads), the same token ids for every engine."""
    rest = ids[TOKENS + PROMPTS * PROMPT_LEN :]
    stride = (len(rest) - PASSAGE_PROMPT) // (PASSAGES - 1)
    return [rest[i * stride : i * stride + PASSAGE_PROMPT] for i in range(PASSAGES)]


def passage_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Mean tokens generated before the first difference from the reference's continuation
    (of PASSAGE_TOKENS), and how many continuations are identical."""
    same = [
        next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
        for out, ref in zip(outputs, reference, strict=True)
    ]
    return {
        "passage_tokens_before_first_difference": round(sum(same) / len(same), 3),
        "passage_identical": sum(n == len(ref) for n, ref in zip(same, reference)),
    }


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    prefix = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
        prefix.append(same / len(ref))
    return {
        "tokens_before_first_difference": round(sum(prefix) / len(prefix), 4),
        "identical_outputs": sum(p == 1.0 for p in prefix),
    }


def bench_accuracy(names: list[str] | None = None) -> dict:
    """The accuracy rows of `names` (default all; bf16, the reference, always first)."""
    from inference.checkpoints.model_zoo import resolve_model

    model_dir = resolve_model("smollm2")
    rows, ids, prompts, reference, passage_reference = {}, None, None, None, None
    chosen = ["bf16", *(n for n in names or ACCURACY_CONFIGS if n != "bf16")]
    for name in chosen:
        options = dict(ACCURACY_CONFIGS[name])
        group = options.pop("int8_act_group", None)
        with patched_environ(options.pop("env", {})):
            engine = accuracy_engine(model_dir, options)
        if ids is None:
            ids = corpus_ids(engine.tokenizer)
            later = ids[TOKENS:]
            prompts = [later[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(PROMPTS)]
        started = time.monotonic()
        with int8_act_group(group):
            ppl = perplexity(engine, ids[:TOKENS], prefix_token(engine.tokenizer))
            row = {"perplexity": ppl, "weight_bytes": engine.weight_bytes}
            outputs = greedy(engine, prompts)
            continuations = greedy(engine, passages(ids), PASSAGE_TOKENS)
        row["seconds"] = round(time.monotonic() - started, 1)
        if reference is None:
            reference, passage_reference = outputs, continuations
        row |= agreement(outputs, reference)
        row |= passage_agreement(continuations, passage_reference)
        row["ppl_increase"] = row["perplexity"] / rows["bf16"]["perplexity"] - 1 if rows else 0.0
        rows[name] = row
        print(
            f"{name:14s} ppl {row['perplexity']:.4f}  +{100 * row['ppl_increase']:.3f}%  "
            f"greedy agreement {row['tokens_before_first_difference']:.3f} "
            f"({row['identical_outputs']}/16 identical)  passages "
            f"{row['passage_tokens_before_first_difference']:.1f}/{PASSAGE_TOKENS}  "
            f"{row['seconds']} s",
            flush=True,
        )
        del engine
    return rows


def accuracy_engine(model_dir, options: dict) -> LLMEngine:
    return LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="bfloat16",
        max_num_batched_tokens=CHUNK,
        max_num_seqs=32,
        kv_cache_tokens=40960,
        enable_prefix_caching=False,
        **options,
    )


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set for the block (an engine's load-time switches), then
    restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)


def bench_speed(rounds: int, preset: str = "small", names: list[str] | None = None) -> dict:
    """The speed rows of `names` (default DEFAULT_SPEED; bf16, the ratios' reference, always)."""
    from bench.decode_floor import (
        engine_weight_bytes_per_token,
        floor_share,
        kv_read_bytes,
        stream_read_bandwidth,
    )

    model_dir = ensure_demo_model(preset)
    chosen = ["bf16", *(n for n in names or DEFAULT_SPEED if n != "bf16")]
    configs = {name: dict(SPEED_CONFIGS[name]) for name in chosen}
    groups = {name: options.pop("int8_act_group", None) for name, options in configs.items()}
    engines = {
        name: LLMEngine.from_pretrained(model_dir, device="cpu", dtype="bfloat16", **options)
        for name, options in configs.items()
    }
    vocab = engines["bf16"].args.vocab_size
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for name, engine in engines.items():
        with int8_act_group(groups[name]):
            engine.generate(make_prompts(4, 128, vocab, seed=99), warm)
    bandwidth = stream_read_bandwidth()  # the floor's: before the rounds and after, the best
    best = {(name, kind): 0.0 for name in engines for kind in ("single", "batched")}
    for r in range(rounds):  # alternating, so a slow patch of the machine hits every engine
        # new prompts each round, the same for every engine: a repeated prompt would be
        # served from the prefix cache, leaving its prefill out of the rate
        prompts = make_prompts(32, 128, vocab, seed=r)
        for kind, batch in (("single", prompts[:1]), ("batched", prompts)):
            for name, engine in engines.items():
                with int8_act_group(groups[name]):
                    best[name, kind] = max(best[name, kind], rate(engine, batch, params))
    bandwidth = max(bandwidth, stream_read_bandwidth())
    config = json.loads((model_dir / "config.json").read_text())
    kv = kv_read_bytes(config, 128 + 128 / 2)  # bf16 cache at the mean context of a decode step
    rows = {}
    for name, engine in engines.items():
        per_token = engine_weight_bytes_per_token(engine) + kv
        rows[name] = {
            "single_stream": round(best[name, "single"], 1),
            "batched": round(best[name, "batched"], 1),
            "weight_bytes": engine.weight_bytes,
            "bytes_per_token": round(per_token),
            "single_stream_floor_share": round(
                floor_share(best[name, "single"], per_token, bandwidth), 3
            ),
        }
        if name != "bf16":
            for kind in ("single_stream", "batched", "weight_bytes"):
                rows[name][f"{kind}_ratio"] = round(rows[name][kind] / rows["bf16"][kind], 3)
        print(name, rows[name], flush=True)
    # KV capacity: the same byte budget in each format, as the engine sizes it
    budget = engines["bf16"].kv_cache_bytes
    capacity = {}
    for fmt in ("auto", "int8", "fp8_e4m3", "int4"):
        engine = LLMEngine.from_pretrained(
            model_dir, device="cpu", dtype="bfloat16", kv_cache_bytes=budget, kv_cache_dtype=fmt
        )
        capacity[fmt] = {"tokens": engine.kv_cache_tokens, "bytes": engine.kv_cache_bytes}
    for fmt in ("int8", "fp8_e4m3", "int4"):
        capacity[fmt]["tokens_ratio"] = round(
            capacity[fmt]["tokens"] / capacity["auto"]["tokens"], 3
        )
    print("kv capacity at", budget, "bytes:", capacity, flush=True)
    return {
        "preset": preset,
        "bandwidth_bytes_s": round(bandwidth),
        "engines": rows,
        "kv_capacity": capacity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accuracy", action="store_true", help="only the perplexity rows")
    parser.add_argument("--speed", action="store_true", help="only the speed rows")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--preset", choices=["small", "medium"], default="small", help="the speed rows' model"
    )
    parser.add_argument(
        "--speed-configs",
        nargs="+",
        choices=list(SPEED_CONFIGS),
        help="only these speed engines (bf16 always, for the ratios); written under "
        "speed_<names> instead of speed",
    )
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="also llama.cpp's accuracy rows (needs bench/peers/setup_peers.sh llamacpp)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(ACCURACY_CONFIGS),
        help="only these accuracy rows (bf16 always runs, as the reference); merged into "
        "the results' accuracy rows",
    )
    args = parser.parse_args()
    both = not (args.accuracy or args.speed)
    if args.llamacpp:  # before hours of our rows
        from bench.peers.run_peers import require_peers

        require_peers(["llamacpp"])
    out = RESULTS / "quant_bench.json"
    record = json.loads(out.read_text()) if out.exists() else {}
    record |= {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name()}
    if args.speed or both:
        key = "speed_" + "+".join(args.speed_configs) if args.speed_configs else "speed"
        record[key] = bench_speed(args.rounds, args.preset, args.speed_configs)
    if args.accuracy or both:
        rows = bench_accuracy(args.configs)
        record["accuracy"] = (record.get("accuracy", {}) | rows) if args.configs else rows
    if args.llamacpp and (args.accuracy or both):
        from bench.peers.llama_accuracy import llamacpp_rows

        record["llamacpp_accuracy"] = llamacpp_rows(["q8_0", "q4_0", "q4_k_m"], os.cpu_count() or 1)
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
