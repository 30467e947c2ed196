"""`make bench`, what scoring a prompt through the API costs against a prefill of the same
tokens (issue 39; target: no more, a ratio of at most 1 within the noise). One
`moeserve serve`, three arms sending the same batch of prompts to /v1/completions at once:

  prefill:          max_tokens 1, nothing scored (the prefill and one sampled token)
  echo:             max_tokens 0, echo, logprobs 1 (lm-eval's loglikelihood requests)
  prompt_logprobs:  max_tokens 1, vLLM's prompt_logprobs 1

Rounds alternate the arms' order (ABBA: forward, then reversed) so a shared machine's drift
hits every arm alike; each arm's figure is the median of its rounds' batch times and the
result the ratio of the scoring arms' medians to the prefill arm's. Every arm of every round
gets prompts of its own first token (the rest the same), so no prompt is a prefix-cache hit
(a scoring request reads its prompt through the model, where a plain one could skip it).
Then, the server stopped, bench/scoring_parts.py times the parts in one process on the same
engine (prefill, the lm_head on every row, the scoring as the runner does it, torch's
log-softmax way before it). Writes bench/results/scoring.json (not with --quick, a check that
it runs).

The arithmetic sets a floor above 1: a prefill runs the lm_head on one row, scoring on every
row (each position's log-softmax needs all its logits), so scoring does the prefill's work
plus T - 1 lm_heads. `arithmetic_floor` counts both per token from the checkpoint (weights a
token multiplies: experts at top_k / num_experts; attention's scores at the mean context):
floor = (body + lm_head) / (body + lm_head / T) in multiply-adds. The small demo's lm_head
(32000 x 512) is 16.4M a token against a body of 24.4M: 1.67. Large models sit near 1
(Mixtral-8x7B: 131M against ~12.9B). The measured ratio can sit below the FLOP floor where
the lm_head's one large GEMM runs faster per multiply-add than the body's layers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.decode_floor import checkpoint_weight_bytes_per_token
from bench.harness import ServerProcess
from bench.machine import cpu_name
from bench.scoring_parts import measure_parts
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).resolve().parent / "results" / "scoring.json"
ARMS = {
    "prefill": {"max_tokens": 1},
    "echo": {"max_tokens": 0, "echo": True, "logprobs": 1},
    "prompt_logprobs": {"max_tokens": 1, "prompt_logprobs": 1},
}


def arithmetic_floor(model_dir: str | os.PathLike, prompt_len: int) -> dict:
    """Multiply-adds a token costs in the body and in the lm_head, and the ratio scoring a
    prompt of prompt_len tokens must cost against its prefill by those counts alone."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    lm_head = config["vocab_size"] * config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qk_dim = config.get("qk_head_dim") or head_dim  # MLA's query-key width differs
    v_dim = config.get("v_head_dim") or head_dim
    scores = config["num_hidden_layers"] * heads * (qk_dim + v_dim) * (prompt_len + 1) / 2
    # weights a token multiplies, one value each (a tied embedding counts whole: the lm_head)
    body = checkpoint_weight_bytes_per_token(model_dir, 1) - lm_head + scores
    t = prompt_len
    return {
        "body_macs_per_token": body,
        "lm_head_macs_per_token": lm_head,
        "floor_ratio": (t * body + t * lm_head) / (t * body + lm_head),
    }


async def _batch(client: httpx.AsyncClient, model: str, prompts, fields: dict) -> float:
    """Sends the prompts at once; seconds until the last answer."""

    async def one(ids: list[int]) -> dict:
        body = {"model": model, "prompt": ids, "temperature": 0.0, **fields}
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(ids) for ids in prompts))
    seconds = time.perf_counter() - started
    for ids, answer in zip(prompts, answers, strict=True):
        if answer["usage"]["prompt_tokens"] != len(ids):
            raise AssertionError(f"prompt of {len(ids)} tokens answered as {answer['usage']}")
        if fields.get("echo") and len(answer["choices"][0]["logprobs"]["token_logprobs"]) != len(
            ids
        ):
            raise AssertionError("echo scored fewer positions than the prompt has")
    return seconds


async def _rounds(url: str, model: str, vocab: int, rounds: int, batch: int, prompt_len: int):
    rng = random.Random(39)
    firsts = iter(rng.sample(range(10, vocab), rounds * len(ARMS)))  # a first token per arm
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        warm = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        await _batch(client, model, warm, ARMS["echo"])  # untimed
        for i in range(rounds):
            tail = [[rng.randrange(10, vocab) for _ in range(prompt_len - 1)] for _ in range(batch)]
            order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))  # ABBA
            for arm in order:
                first = next(firsts)
                prompts = [[first, *rest] for rest in tail]
                times[arm].append(await _batch(client, model, prompts, ARMS[arm]))
    return times


def measure(
    model_dir: str | os.PathLike,
    rounds: int = 8,
    batch: int = 8,
    prompt_len: int = 512,
    server_args: tuple = ("--dtype", "bfloat16"),
) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    args = ["--max-model-len", prompt_len + 16, "--max-num-seqs", batch, *server_args]
    with ServerProcess(model_dir, *args, start_timeout=600) as srv:
        url = f"http://127.0.0.1:{srv.rest_port}"
        times = asyncio.run(_rounds(url, srv.started["model"], vocab, rounds, batch, prompt_len))
    # then, the server gone, the same engine's parts in this process (bench/scoring_parts.py)
    dtype = server_args[server_args.index("--dtype") + 1] if "--dtype" in server_args else "auto"
    parts = measure_parts(model_dir, rounds, batch, prompt_len, dtype)
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "workload": {
            "model": str(model_dir),
            "server_args": [str(a) for a in args],
            "batch": batch,
            "prompt_len": prompt_len,
            "rounds": rounds,
        },
        "seconds": times,
        "median_seconds": medians,
        "echo_over_prefill": medians["echo"] / medians["prefill"],
        "prompt_logprobs_over_prefill": medians["prompt_logprobs"] / medians["prefill"],
        "arithmetic_floor": arithmetic_floor(model_dir, prompt_len),
        "parts": parts,
        "target": "ratios <= 1 (scoring costs no more than a prefill); floor by multiply-adds in"
        " arithmetic_floor.floor_ratio",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="demo model size")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--quick", action="store_true", help="the tiny model, 2 rounds; prints, writes nothing"
    )
    args = parser.parse_args()
    if args.quick:
        result = measure(ensure_demo_model("tiny"), rounds=2, batch=2, prompt_len=64)
    else:
        result = measure(ensure_demo_model(args.preset), args.rounds, args.batch, args.prompt_len)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"scoring / prefill, ratio of medians: echo {result['echo_over_prefill']:.3f}, "
        f"prompt_logprobs {result['prompt_logprobs_over_prefill']:.3f} "
        f"(floor by multiply-adds {result['arithmetic_floor']['floor_ratio']:.3f}, "
        f"measured: prefill + lm_head {result['parts']['floor']:.3f}; scoring passes "
        f"{result['parts']['scoring_over_lm_head']:.3f}x the lm_head, torch's log-softmax "
        f"{result['parts']['log_softmax_over_lm_head']:.3f}x)"
        + ("" if args.quick else f" -> {RESULTS}")
    )


if __name__ == "__main__":
    main()
