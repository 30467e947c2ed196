"""`make bench`, serving tax: output tokens/s through the REST API with 16 concurrent
streams against the offline engine on the same requests (target: ratio >= 0.9).

Both sides run the same 64 requests per round (128 random prompt token ids, 128 greedy output
tokens, EOS ignored) on the `small` demo model in bfloat16, with max_num_seqs equal to the REST
concurrency so both see the same batch sizes: the ratio is the cost of HTTP, SSE, the event
loop and the pipe to the server's engine core process, not of a different batch shape.

Both are loaded before anything is timed (the server in its own process, idle while the offline
engine runs, and the other way round) and warmed up on other prompts of the same shapes. Rounds
alternate offline/REST (ABBA), each round on fresh prompts; the ratio is the median of the
per-round REST/offline ratios, so that the drift of a shared VM hits both sides of each pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import ServerProcess
from bench.rest_load import closed_loop, streaming_body
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"


def offline_round(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def rest_round(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    bodies = [streaming_body(p, output_len) for p in prompts]
    seconds, tokens = asyncio.run(closed_loop(url, bodies, concurrency))
    assert tokens == len(prompts) * output_len, tokens
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="offline/REST pairs")
    args = parser.parse_args(argv)
    model = ensure_demo_model(args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def prompts(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.requests)
        ]

    engine = LLMEngine.from_pretrained(
        model, device=args.device, dtype="bfloat16", max_num_seqs=args.concurrency
    )
    flags = [
        "--device",
        args.device,
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        str(args.concurrency),
    ]
    rounds = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess(
            model, *flags, log_path=Path(tmp) / "server.log", start_timeout=300, stop_timeout=60
        ) as server,
    ):
        url = server.url
        warm = prompts(1000)  # other prompts, same shapes: oneDNN builds kernels per shape
        offline_round(engine, warm, 4)
        rest_round(url, warm, 4, args.concurrency)
        for r in range(args.rounds):
            batch = prompts(r)  # fresh each round: no prefix-cache hits from an earlier round
            order = ("offline", "rest") if r % 2 == 0 else ("rest", "offline")
            rates = {}
            for side in order:
                rates[side] = (
                    offline_round(engine, batch, args.output_len)
                    if side == "offline"
                    else rest_round(url, batch, args.output_len, args.concurrency)
                )
            rounds.append({**rates, "ratio": rates["rest"] / rates["offline"]})
            print(
                f"round {r}: REST {rates['rest']:.1f} tok/s, offline {rates['offline']:.1f} tok/s, "
                f"ratio {rounds[-1]['ratio']:.3f}",
                flush=True,
            )
    ratio = statistics.median(r["ratio"] for r in rounds)
    rest_tps = statistics.median(r["rest"] for r in rounds)
    engine_tps = statistics.median(r["offline"] for r in rounds)
    print(
        f"serving tax: REST {rest_tps:.1f} tok/s with {args.concurrency} streams vs offline engine "
        f"{engine_tps:.1f} tok/s (medians) -> ratio {ratio:.3f} (median of {args.rounds} paired rounds; "
        f"target >= 0.9)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serving_bench.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": platform.platform(),
                "rest_tokens_per_s": rest_tps,
                "offline_tokens_per_s": engine_tps,
                "ratio": ratio,
                "rounds": rounds,
                "config": {k: str(v) for k, v in vars(args).items()},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
