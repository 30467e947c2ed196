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
Writes bench/results/scoring.json (not with --quick, a check that it runs).
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

from bench.harness import ServerProcess
from bench.machine import cpu_name
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).resolve().parent / "results" / "scoring.json"
ARMS = {
    "prefill": {"max_tokens": 1},
    "echo": {"max_tokens": 0, "echo": True, "logprobs": 1},
    "prompt_logprobs": {"max_tokens": 1, "prompt_logprobs": 1},
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
        "target": "ratios <= 1 (scoring costs no more than a prefill)",
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
        f"prompt_logprobs {result['prompt_logprobs_over_prefill']:.3f}"
        + ("" if args.quick else f" -> {RESULTS}")
    )


if __name__ == "__main__":
    main()
