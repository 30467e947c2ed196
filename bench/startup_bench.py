"""Cold and warm starts (issue 37): `moeserve serve` from launch to serving, by phase, for the
demo model and SmolLM2, with our CPU kernels cached or not and the weights in the page cache
or not. Writes bench/results/startup_bench.json and prints the table for bench/NOTES.md.

    python -m bench.startup_bench [--models demo smollm2] [--rounds 3]

Each start's phases come from its own /ready (moeserve_startup_phase_seconds' numbers).
Kernels "cold": the server gets a fresh MOESERVE_CACHE_DIR, so it builds them (the models
are passed as folders, resolved from the usual cache beforehand). Weights "cold": every file
of the checkpoint is dropped from the page cache first (posix_fadvise DONTNEED: clean pages
go, no root needed); "warm": read once just before. The median start of `--rounds` is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

from bench.harness import ServerProcess
from bench.machine import cpu_name
from inference.startup import PHASES

RESULTS = Path(__file__).parent / "results"
SCENARIOS = {  # name -> (kernels cached, weights in the page cache)
    "cold": (False, False),
    "cold kernels": (False, True),
    "cold weights": (True, False),
    "warm": (True, True),
}


def evict(folder: Path) -> None:
    """Drops the folder's files from the page cache (those pages that are clean)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_through(folder: Path) -> None:
    """Reads every file once, so the next start finds it in the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 24):
                    pass


def one_start(model: Path, cache_dir: Path) -> dict[str, float]:
    """A server's start, by phase (seconds), as its /ready reports them."""
    env = {"MOESERVE_CACHE_DIR": str(cache_dir), "OTEL_TRACES_EXPORTER": "none"}
    with ServerProcess(model, "--device", "cpu", env=env, start_timeout=600) as server:
        ready = httpx.get(server.url + "/ready", timeout=30).json()
    return {p["phase"]: p["seconds"] for p in ready["startup"]}


def median_start(starts: list[dict[str, float]]) -> dict[str, float]:
    """The start whose total is the median (its phases kept together, not mixed)."""
    ranked = sorted(starts, key=lambda s: sum(s.values()))
    return ranked[(len(ranked) - 1) // 2]


def table(rows: list[dict]) -> str:
    """Markdown: one row per model and scenario, the total and each phase reached."""
    head = "| model | start | total s | " + " | ".join(PHASES) + " |"
    lines = [head, "|---|---|" + "---:|" * (1 + len(PHASES))]
    for r in rows:
        phases = r["phases"]
        cells = [f"{phases[p]:.2f}" if p in phases else "-" for p in PHASES]
        total = sum(phases.values())
        lines.append(
            f"| {r['model']} | {r['scenario']} | {total:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo", "smollm2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "startup_bench.json")
    args = parser.parse_args(argv)
    from inference.checkpoints.model_zoo import resolve_model

    rows = []
    for name in args.models:
        folder = resolve_model(name, demo_preset="small")
        with tempfile.TemporaryDirectory() as warm_cache:
            one_start(folder, Path(warm_cache))  # builds the kernels this scenario reuses
            for scenario, (kernels_cached, weights_cached) in SCENARIOS.items():
                starts = []
                for _ in range(args.rounds):
                    with tempfile.TemporaryDirectory() as fresh:
                        (read_through if weights_cached else evict)(folder)
                        cache = Path(warm_cache) if kernels_cached else Path(fresh)
                        starts.append(one_start(folder, cache))
                rows.append({"model": name, "scenario": scenario, "phases": median_start(starts)})
                print(rows[-1], file=sys.stderr)
    print(table(rows))
    args.out.write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
