"""`python -m bench.scenarios` (make scenarios, make soak): runs the fault scenarios, prints
their table, writes bench/results/scenarios.json.

    python -m bench.scenarios                      # the full set (not the soak)
    python -m bench.scenarios --only arrival_burst,hostile_input
    python -m bench.scenarios --only soak          # make soak: 30 minutes at 80% capacity
    python -m bench.scenarios --profile ci         # CI's short phases, no Prometheus
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.scenarios.catalog import CAPACITY_USERS, SCENARIOS
from bench.scenarios.runner import CI, FULL, calibrate, run_scenario
from bench.scenarios.score import RESULTS, score, table, write_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios", description=__doc__)
    p.add_argument("--profile", choices=["full", "ci"], default="full")
    p.add_argument("--only", help="comma-separated scenario names (default: the full set)")
    p.add_argument("--soak-minutes", type=float, default=30.0)
    p.add_argument("--model", help="checkpoint folder (default: the demo model)")
    p.add_argument("--workdir", type=Path, help="logs and Prometheus data (default: a temp dir)")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--note", help="a remark stored with the results (e.g. machine load)")
    ns = p.parse_args(argv)
    profile = FULL if ns.profile == "full" else CI
    profile = replace(profile, soak_s=ns.soak_minutes * 60)
    if ns.model:
        profile = replace(profile, model=ns.model)
    names = ns.only.split(",") if ns.only else [n for n, s in SCENARIOS.items() if s.in_full]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    workdir = ns.workdir or Path(tempfile.mkdtemp(prefix="moeserve-scenarios-"))
    print(f"scenarios {names} ({profile.name}); logs under {workdir}", flush=True)
    rows, cache = [], {}
    if profile.stack and set(names) & CAPACITY_USERS:
        cache["capacity"] = asyncio.run(calibrate(profile, workdir / "calibrate"))
        print(f"capacity: {cache['capacity']:.2f} requests/s", flush=True)
    for name in names:
        t0 = time.monotonic()
        row = asyncio.run(run_scenario(SCENARIOS[name], profile, workdir / name, cache))
        rows.append(row)
        bad = [k for k, v in row["invariants"].items() if not v["ok"]]
        print(
            f"{name}: {row['sent']} sent, {row['completed']} ok, {row['rejected_429']} 429, "
            f"{row['failed']} failed, {row['lost']} lost, {row['5xx']} 5xx; alerts "
            f"{[a['alertname'] for a in row['alerts']]}; cause {row['predicted_cause']} "
            f"(truth {row['cause']}); invariants {'ok' if not bad else bad} "
            f"({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    meta = {"profile": profile.name}
    if ns.note:
        meta["note"] = ns.note
    if ns.no_write:
        doc = {"scenarios": rows, **score(rows)}
    else:
        doc = write_results(rows, ns.results, **meta)
    print(table(doc))
    print(json.dumps({k: v for k, v in doc.items() if k != "scenarios"}))
    return 0 if all(r["invariants_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
