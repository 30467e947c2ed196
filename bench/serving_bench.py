"""`make bench`, serving tax: output tokens/s through the REST API with 16 concurrent
streams against the offline engine on the same requests (target: ratio >= 0.9).

Both sides run the same 64 requests (128 random prompt token ids, 128 greedy output tokens,
EOS ignored) on the `small` demo model in bfloat16, with max_num_seqs equal to the REST
concurrency so both see the same batch sizes: the ratio is the cost of HTTP, SSE,
detokenisation for the wire and the event loop, not of a different batch shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.rest_load import closed_loop, start_server, streaming_body
from inference import LLMEngine, SamplingParams
from inference.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"


def offline(model: Path, prompts: list[list[int]], args) -> float:
    engine = LLMEngine.from_pretrained(model, device=args.device, dtype="bfloat16",
                                       max_num_seqs=args.concurrency)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def served(model: Path, prompts: list[list[int]], args, tmp: Path) -> float:
    flags = ["--device", args.device, "--dtype", "bfloat16", "--max-num-seqs", str(args.concurrency)]
    proc, url = start_server(model, flags, {}, tmp / "server.log")
    try:
        asyncio.run(closed_loop(url, [streaming_body(p, 4) for p in prompts[:2]], 2))  # warm-up
        bodies = [streaming_body(p, args.output_len) for p in prompts]
        seconds, tokens = asyncio.run(closed_loop(url, bodies, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(60)
    assert tokens == len(prompts) * args.output_len, tokens
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args(argv)
    model = ensure_demo_model(args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    # the offline engine runs in this process; the server gets the cores to itself afterwards
    engine_tps = offline(model, prompts, args)
    with tempfile.TemporaryDirectory() as tmp:
        rest_tps = served(model, prompts, args, Path(tmp))
    ratio = rest_tps / engine_tps
    print(f"serving tax: REST {rest_tps:.1f} tok/s with {args.concurrency} streams vs offline engine "
          f"{engine_tps:.1f} tok/s -> ratio {ratio:.3f} (target >= 0.9)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serving_bench.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
        "rest_tokens_per_s": rest_tps, "offline_tokens_per_s": engine_tps, "ratio": ratio,
        "config": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
