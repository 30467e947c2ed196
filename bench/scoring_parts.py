"""Where prompt scoring's time goes (issue 39), in one process on the engine the server runs:
per round, on one batch of prompts of their own (no prefix-cache hit),

  prefill:      the engine's prefill of the batch (generate, max_tokens 1)
  lm_head:      the lm_head on every scored row (each prompt's all but its last): the
                products scoring adds to a prefill, nothing else
  scoring:      executor/prompt_scores.score_rows on the same rows, as the model runner calls
                it (on the CPU kernels: the lm_head and the scoring passes fused in C)
  log_softmax:  the way before it: torch's float32 log-softmax of each 256 rows' logits, the
                target's logprob gathered, its rank by a comparison, the top-1

in alternating order (ABBA); each part's figure is its median. `floor`: (prefill + lm_head) /
prefill, what scoring through the API can reach once everything but the lm_head's products
costs nothing; `scoring_over_lm_head`: what the scoring passes add to those products.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch

from inference import LLMEngine, SamplingParams
from inference.executor.prompt_scores import score_rows

PARTS = ("prefill", "lm_head", "scoring", "log_softmax")


def _log_softmax_way(model, hidden: torch.Tensor, targets: torch.Tensor) -> None:
    for i in range(0, hidden.shape[0], 256):
        lp = model.logits(hidden[i : i + 256]).float().log_softmax(dim=-1)
        chosen = lp.gather(1, targets[i : i + 256].unsqueeze(1))
        ((lp > chosen).sum(dim=-1) + 1).tolist()
        lp.topk(1, dim=-1)


def measure_parts(
    model_dir: str | os.PathLike,
    rounds: int = 8,
    batch: int = 8,
    prompt_len: int = 512,
    dtype: str = "bfloat16",
) -> dict:
    engine = LLMEngine.from_pretrained(
        model_dir, device="cpu", dtype=dtype, max_num_seqs=batch, max_model_len=prompt_len + 16
    )
    model, vocab = engine.executor.model, engine.args.vocab_size
    rng = random.Random(40)
    rows = prompt_len - 1  # a prompt's scored rows: each predicts the token after it
    hidden = torch.randn(batch, rows, engine.args.hidden_size).to(model.dtype)
    targets = torch.randint(0, vocab, (batch, rows))
    plain = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill() -> None:
        prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        engine.generate(prompts, plain)

    @torch.inference_mode()
    def each_sequence(part: str) -> None:
        for h, t in zip(hidden, targets):
            if part == "lm_head":
                model.logits(h)
            elif part == "scoring":
                score_rows(model, h, t.tolist(), 1)
            else:
                _log_softmax_way(model, h, t)

    run = {"prefill": prefill, **{p: (lambda p=p: each_sequence(p)) for p in PARTS[1:]}}
    for part in PARTS:  # untimed: caches, threads and the kernels' scratch warmed
        run[part]()
    seconds: dict[str, list[float]] = {p: [] for p in PARTS}
    for i in range(rounds):
        for part in PARTS if i % 2 == 0 else reversed(PARTS):
            started = time.perf_counter()
            run[part]()
            seconds[part].append(time.perf_counter() - started)
    medians = {p: statistics.median(s) for p, s in seconds.items()}
    return {
        "seconds": seconds,
        "median_seconds": medians,
        "floor": (medians["prefill"] + medians["lm_head"]) / medians["prefill"],
        "scoring_over_lm_head": medians["scoring"] / medians["lm_head"],
        "log_softmax_over_lm_head": medians["log_softmax"] / medians["lm_head"],
    }
