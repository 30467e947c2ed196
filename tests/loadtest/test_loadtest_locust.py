"""loadtest/locustfile.py, headless, against the real server on loopback (with an API key, which
the users send as a REST header and as gRPC metadata): REST chat, REST completions and gRPC
users all stream, with TTFT/TPOT entries and no failures."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
LOCUST = Path(sys.executable).with_name("locust")


def _run_locust(
    live_server, tmp_path: Path, *extra: str, run_time: str = "5s", users: int = 4
) -> tuple[subprocess.CompletedProcess, Path]:
    prefix = tmp_path / "locust"
    env = dict(
        os.environ,
        MOESERVE_GRPC_TARGET=live_server.grpc_target,
        MOESERVE_SERVED_MODEL_NAME=live_server.model,
        MOESERVE_API_KEY=live_server.api_key,
    )
    cmd = [
        str(LOCUST),
        "-f",
        str(LOADTEST / "locustfile.py"),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        run_time,
        "--host",
        live_server.url,
        "--csv",
        str(prefix),
        "--html",
        str(tmp_path / "report.html"),
        "--only-summary",
        "--stop-timeout",
        "10",
        "--prompt-tokens",
        "8-40",
        "--output-tokens",
        "6-12",
        "--request-log",
        str(tmp_path / "requests.csv"),
        *extra,
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    return proc, prefix


def _stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


@pytest.mark.slow
def test_headless_run_records_ttft_and_tpot_without_failures(live_server, tmp_path):
    proc, prefix = _run_locust(live_server, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    stats = _stats(prefix)
    for name in ("/v1/chat/completions", "/v1/completions", "GenerateStream"):
        method = "gRPC" if name == "GenerateStream" else "POST"
        for key in ((method, name), ("TTFT", f"TTFT {name}"), ("TPOT", f"TPOT {name}")):
            assert key in stats, f"no {key} entry in {sorted(stats)}\n{output}"
            assert int(stats[key]["Request Count"]) > 0, key
    for key, row in stats.items():
        assert row["Failure Count"] == "0", (key, row, output)
    # TTFT is part of the request; TPOT is far below a whole request here (>= 6 tokens)
    for name, method in (("/v1/chat/completions", "POST"), ("GenerateStream", "gRPC")):
        request_avg = float(stats[(method, name)]["Average Response Time"])
        assert float(stats[("TTFT", f"TTFT {name}")]["Average Response Time"]) < request_avg
        assert float(stats[("TPOT", f"TPOT {name}")]["Average Response Time"]) < request_avg
    assert (tmp_path / "report.html").stat().st_size > 1000

    # every request has its own trace id; the slowest are reported with theirs
    with open(tmp_path / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(re.fullmatch(r"[0-9a-f]{32}", r["trace_id"]) for r in rows)
    assert len({r["trace_id"] for r in rows}) == len(rows)
    assert {r["api"] for r in rows} == {"REST", "gRPC"}
    assert all(1 <= int(r["output_tokens"]) <= 12 for r in rows)
    # the CSV holds the final numbers: one request entry per logged request
    assert sum(
        int(row["Request Count"]) for (kind, _), row in stats.items() if kind in ("POST", "gRPC")
    ) == len(rows)
    with open(f"{prefix}_slowest.csv", newline="") as f:
        slowest = list(csv.DictReader(f))
    assert slowest and slowest[0]["trace_id"] in {r["trace_id"] for r in rows}
    assert "slowest requests" in output


@pytest.mark.slow
def test_tags_pick_user_classes(live_server, tmp_path):
    proc, prefix = _run_locust(live_server, tmp_path, "--tags", "grpc", run_time="2s", users=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {name for _, name in _stats(prefix)}
    assert "TTFT GenerateStream" in names
    assert not any("/v1/" in n for n in names), names
