"""The seed's TCO table: $/1M output tokens on this machine at a configured price, from the
throughput `make bench` measured (bench/results/quant_bench.json: the small demo model in
each weight format, single stream and batched 32 x 128 -> 128). Nothing is timed here.

    python -m bench.tco --cost-per-hour 1.50 [--results bench/results/quant_bench.json]
        [--json bench/results/tco.json]

A format's row appears once its measurement does (int4 when the 4-bit issue's bench adds it).
The same arithmetic as the live gauge (telemetry/cost.py): price / 3600 / tokens per second,
per million tokens, at full load (a server idle part of the hour costs more per token: the
gauge measures that, this table the floor).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from telemetry.cost import cost_per_million_tokens

RESULTS = Path(__file__).parent / "results"
FORMATS = ("bf16", "int8", "fp8", "int4")  # table order; those measured appear
LOADS = ("single_stream", "batched")


def tco_rows(speed: dict, cost_per_hour: float) -> list[dict]:
    """One row per measured weight format: its tokens/s per load and $/1M output tokens."""
    engines = speed["engines"]
    rows = []
    for fmt in [f for f in FORMATS if f in engines] + sorted(set(engines) - set(FORMATS)):
        measured = engines[fmt]
        row: dict = {"format": fmt, "cost_per_hour": cost_per_hour}
        for load in LOADS:
            tps = measured.get(load)
            row[f"{load}_tokens_per_s"] = tps
            row[f"{load}_usd_per_million"] = (
                None if not tps else round(cost_per_million_tokens(cost_per_hour, tps), 4)
            )
        rows.append(row)
    return rows


def markdown(rows: list[dict], cpu: str, date: str) -> str:
    price = rows[0]["cost_per_hour"] if rows else 0.0
    lines = [
        f"$/1M output tokens at ${price:g}/hour on {cpu} (throughput measured {date}):",
        "",
        "| weights | single stream tok/s | $/1M | batched tok/s | $/1M |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["format"]]
        for load in LOADS:
            tps, usd = r[f"{load}_tokens_per_s"], r[f"{load}_usd_per_million"]
            cells += ["-" if tps is None else f"{tps:g}", "-" if usd is None else f"{usd:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-per-hour", type=float, required=True, help="USD per hour")
    parser.add_argument("--results", type=Path, default=RESULTS / "quant_bench.json")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not args.cost_per_hour >= 0:
        parser.error("--cost-per-hour must be a non-negative number of USD")
    measured = json.loads(args.results.read_text())
    rows = tco_rows(measured["speed"], args.cost_per_hour)
    print(markdown(rows, measured.get("cpu", "?"), measured.get("date", "?")))
    if args.json is not None:
        out = {"cpu": measured.get("cpu"), "measured": measured.get("date"), "rows": rows}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
