"""`make bench`, speculative decoding (issue 38): the same engine with and without n-gram drafts
(--speculative-config), greedy, on three workloads, in alternating rounds (ABBA: the drift of
a shared VM hits both arms of each pair); each figure is the ratio of the median tokens/s with
speculation to the median without. Targets: >= 1.6x where the answer repeats the prompt,
>= 0.97x on free prose, >= 0.95x at 32 concurrent streams.

  repeat:    one stream asked to rename a given function and show it whole (the answer copies
             the prompt's code)
  prose:     one stream writing a story (little to look up)
  streams32: 32 concurrent prose streams (past disable_by_batch_size: no speculation)

Models: SmolLM2-135M-Instruct (trained: its answers do repeat the prompt) and the small demo
MoE (random weights: its text means nothing, what it accepts comes from its own loops). Greedy
outputs are compared too (they must be identical). Writes bench/results/spec.json; `--quick`
runs the tiny demo model for a few tokens (a function check, no figures worth keeping).

`--method mtp` drafts with an MTP layer instead (k = 3) on the tiny DeepSeek-V3 demo given one
(inference/checkpoints/mtp_layer.py), in two checkpoints: "self" has an MTP layer that drafts
the target's own next token (acceptance near 1: the most MTP can give on this engine), "random"
one drawn at random (acceptance near 0: what drafting costs when nothing is accepted; the
adaptive draft length pauses it). Writes bench/results/spec_mtp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ensure_demo_model
from inference.checkpoints.mtp_layer import write_with_mtp_layer

RESULTS = Path(__file__).resolve().parent / "results" / "spec.json"
MTP_RESULTS = RESULTS.with_name("spec_mtp.json")
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 5,
}
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 3}
TARGETS = {"repeat": 1.6, "prose": 0.97, "streams32": 0.95}

# The repeat workload edits a given function: rename it and show the whole function, so the
# answer copies the prompt. (SmolLM2-135M follows this one, copying the body line for line;
# asked to rename a parameter of a loop it rewrote the loop instead, and drafts were seldom
# accepted.)
CODE = '''def describe_user(user):
    """A one-line summary of a user record."""
    name = user.get("name", "unknown")
    email = user.get("email", "unknown")
    city = user.get("city", "unknown")
    country = user.get("country", "unknown")
    age = user.get("age", 0)
    if age < 18:
        group = "minor"
    elif age < 65:
        group = "adult"
    else:
        group = "senior"
    return f"{name} <{email}>, {city}, {country} ({group})"
'''
REPEAT = (
    "Rename the function `describe_user` to `summarize_user`. Keep everything else the same "
    "and show the whole function.\n\n```python\n" + CODE + "```"
)
OPENINGS = [
    "The lighthouse keeper had not seen a ship in",
    "On the morning the river froze, the children of the village",
    "Nobody in the city remembered who had built the tower, but",
    "The letter arrived forty years late, addressed to",
]


def user_turn(tokenizer, text: str) -> list[int]:
    """The prompt as /v1/chat/completions would send it (the chat template, where the model
    has one: SmolLM2-Instruct answers the request instead of continuing the text)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return tokenizer.encode(text)


def workloads(engine: LLMEngine) -> dict[str, list[list[int]]]:
    tok = engine.tokenizer
    prose = [user_turn(tok, f"Write a short story. {o}") for o in OPENINGS]
    return {
        "repeat": [user_turn(tok, REPEAT)],
        "prose": prose[:1],
        "streams32": [
            user_turn(tok, f"Write a short story. {OPENINGS[i % len(OPENINGS)]} ({i})")
            for i in range(32)
        ],
    }


def _round(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decodes the prompts to completion: tokens/s, the outputs, the drafts' counts."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    outputs, drafted, accepted, tokens = {}, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished:
        step_outputs, stats = engine.step()
        tokens += stats.num_generated_tokens
        drafted += stats.spec_num_draft_tokens
        accepted += stats.spec_num_accepted_tokens
        outputs.update({o.request_id: o.token_ids for o in step_outputs if o.finished})
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / seconds,
        "outputs": [outputs[rid] for rid in ids],
        "drafted": drafted,
        "accepted": accepted,
    }


def measure(model_dir: str, rounds: int, max_tokens: int, dtype: str, spec: dict = SPEC) -> dict:
    limits = {"kv_cache_tokens": 65536, "max_num_seqs": 32}
    engines = {
        "off": LLMEngine.from_pretrained(model_dir, "cpu", dtype, **limits),
        "on": LLMEngine.from_pretrained(model_dir, "cpu", dtype, speculative_config=spec, **limits),
    }
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = {}
    for name, prompts in workloads(engines["off"]).items():
        for engine in engines.values():  # warm-up, untimed
            _round(engine, prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
        rates: dict[str, list[float]] = {"off": [], "on": []}
        identical, drafted, accepted = True, 0, 0
        for i in range(rounds):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            results = {arm: _round(engines[arm], prompts, params) for arm in order}
            for arm, r in results.items():
                rates[arm].append(r["tokens_per_s"])
            identical &= results["on"]["outputs"] == results["off"]["outputs"]
            drafted += results["on"]["drafted"]
            accepted += results["on"]["accepted"]
        rows[name] = {
            "streams": len(prompts),
            "tokens_per_s": {arm: statistics.median(v) for arm, v in rates.items()},
            "rounds": rates,
            "on_over_off": statistics.median(rates["on"]) / statistics.median(rates["off"]),
            "target": TARGETS[name],
            "identical_outputs": identical,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
        }
    return rows


def run(
    models: dict[str, str], rounds: int, max_tokens: int, dtype: str, spec: dict = SPEC
) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "speculative_config": spec,
        "workload": {"greedy": True, "max_tokens": max_tokens, "dtype": dtype, "rounds": rounds},
        "models": {
            name: measure(path, rounds, max_tokens, dtype, spec) for name, path in models.items()
        },
    }


def mtp_models() -> dict[str, str]:
    """The tiny DeepSeek-V3 demo with an MTP layer, drafting its own next token ("self") or
    drawn at random ("random"): written once beside the demo checkpoint (under a temporary
    name, renamed into place)."""
    src = ensure_demo_model("tiny", arch="deepseek_v3")
    models = {}
    for name, self_predicting in (("self", True), ("random", False)):
        path = src.with_name(f"{src.name}-mtp-{name}")
        if not (path / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
            write_with_mtp_layer(src, tmp / "m", self_predicting)
            os.replace(tmp / "m", path)
            tmp.rmdir()
        models[f"deepseek_v3-tiny-mtp-{name}"] = str(path)
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny demo model, a few tokens")
    parser.add_argument("--method", choices=("ngram", "mtp"), default="ngram")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out or (MTP_RESULTS if args.method == "mtp" else RESULTS)
    if args.method == "mtp":  # the tiny DeepSeek-V3 demo's two MTP layers, in bf16
        rounds, max_tokens = (2, 8) if args.quick else (args.rounds, args.max_tokens)
        result = run(mtp_models(), rounds, max_tokens, "bfloat16", MTP_SPEC)
    elif args.quick:
        models = {"demo-tiny": str(ensure_demo_model("tiny"))}
        result = run(models, rounds=2, max_tokens=8, dtype="float32")
    else:
        from inference.checkpoints.model_zoo import resolve_model

        models = {
            "smollm2": str(resolve_model("smollm2")),
            "demo-small": str(ensure_demo_model("small")),
        }
        result = run(models, args.rounds, args.max_tokens, "bfloat16")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for model, rows in result["models"].items():
        for name, row in rows.items():
            rate = row["acceptance_rate"]
            print(
                f"{model} {name}: {row['on_over_off']:.3f}x (target >= {row['target']}), "
                f"identical {row['identical_outputs']}, acceptance "
                f"{'-' if rate is None else f'{rate:.2f}'}"
            )
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
