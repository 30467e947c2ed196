"""`make bench`: the routed-experts kernel alone (cpu_kernels.moe), a benchmark, not a test.

The `medium` demo preset's experts (D 1,024, I 1,536, 16 experts, top 2) in one quantized format,
LAYERS layers of distinct random experts read in turn, so the weights stream from memory as in
a decode step; for each token count, ms a layer (best of `rounds`) and the bytes of the experts
the tokens chose over that time. At 32 tokens every expert gets ~4 rows: the many-row tile, the
case batched decoding spends most of its time in. To compare two trees, run it in each
(alternating) and compare their lines.

Results in bench/results/moe_kernel.json {date, cpu, threads, format, rows: [{tokens, ms_per_layer,
gb_s}]}.

    python -m bench.moe_kernel_bench                      # int4, 1 / 8 / 32 / 128 tokens
    python -m bench.moe_kernel_bench --format int8 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.machine import cpu_name
from inference.kernels import cpu
from inference.models.moe import select_experts
from inference.quantization import qweight as quant

RESULTS = Path(__file__).parent / "results"
D, I, EXPERTS, TOP_K, LAYERS = 1024, 1536, 16, 2, 10  # the medium preset's MoE layers


def expert_layers(fmt: str, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        w13 = torch.randn(EXPERTS, 2 * I, D, generator=g) * 0.1
        w2 = torch.randn(EXPERTS, D, I, generator=g) * 0.1
        packed = (cpu.pack_qweight(quant.quantize(w, fmt)) for w in (w13, w2))
        layers.append(tuple(packed))
    return layers


def weight_bytes(layers: list[tuple]) -> int:
    return sum(t.numel() * t.element_size() for w in sum(layers, ()) for t in (w.data, w.scale))


def time_tokens(layers: list[tuple], tokens: int, rounds: int, total_bytes: int) -> dict:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g).bfloat16()
    best, used = float("inf"), EXPERTS
    for _ in range(rounds):  # new routing each round, the same for every layer
        weights, ids = select_experts(
            torch.rand(tokens, EXPERTS, generator=g).softmax(-1), TOP_K, True
        )
        t0 = time.perf_counter()
        for w13, w2 in layers:
            cpu.moe(x, w13, w2, ids, weights)
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, used = elapsed, len(ids.unique())
    return {
        "tokens": tokens,
        "ms_per_layer": round(best / LAYERS * 1e3, 3),
        "gb_s": round(total_bytes * used / EXPERTS / best / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", default="int4", choices=["int4", "int8", "fp8"])
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_kernel.json")
    args = parser.parse_args()
    isa = cpu.enable_once()
    if isa is None:
        print("no CPU kernels on this machine (ATen's path): nothing to time")
        return
    layers = expert_layers(args.format)
    total = weight_bytes(layers)
    print(
        f"MoE kernel, {cpu_name()}, {torch.get_num_threads()} threads, {isa} (int4: {cpu.INT4}), "
        f"{args.format}, {LAYERS} layers of {EXPERTS} experts, {total / 1e6:.0f} MB"
    )
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = time_tokens(layers, tokens, args.rounds, total)
        rows.append(row)
        print(f"  {tokens:4d} tokens {row['ms_per_layer']:8.3f} ms a layer {row['gb_s']:6.1f} GB/s")
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "format": args.format,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
