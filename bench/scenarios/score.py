"""Rows, scores and the results file.

A row says what the scenario's requests got (sent / completed / rejected_429 / failed / lost,
5xx, TTFT and TPOT percentiles), the server's peak resident memory, the invariants, the
alerts Prometheus fired (seconds after the fault began) and the webhook's incidents with
their ranked causes.

Scoring the webhook: a scenario's predicted cause is the top-ranked cause of its first
incident (the one an operator reads first). Over the scenarios that should alert, a
prediction equal to the ground truth is a true positive; a wrong one is a false positive
and a false negative; no incident at all is a false negative. An incident in a scenario
that should not alert is a false alert (a false positive). F1 = 2PR / (P + R).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO
from bench.machine import cpu_name
from bench.scenarios.load import latency_ms

RESULTS = REPO / "bench" / "results" / "scenarios.json"

# The webhook's causes (telemetry/anomaly/causes.py) and, for incidents from a webhook that
# ranks only series, the cause each series stands for.
SERIES_CAUSE = {
    "arrival_rate": "queue",
    "requests_waiting": "queue",
    "queue_time_p95_seconds": "queue",
    "ttft_p95_seconds": "queue",
    "e2e_p95_seconds": "queue",
    "prompt_tokens_per_request": "prefill",
    "tpot_p95_seconds": "step_time",
    "step_seconds_per_sequence": "step_time",
    "requests_running": "queue",
    "generation_tokens_per_second": "queue",
    "kv_cache_usage_ratio": "kv_cache",
    "preemptions_per_second": "kv_cache",
    "spans_dropped_per_second": "trace_export",
    "error_ratio": "engine",
    "target_up": "engine",
    "expert_imbalance": "expert_imbalance",
}


def ranked_causes(incident: dict[str, Any]) -> list[str]:
    """The incident's causes, best first (from its series when it comes from a webhook that
    ranks no causes)."""
    if "causes" in incident:
        return [c["cause"] for c in incident["causes"]]
    out: list[str] = []
    for name in incident.get("top_metrics") or []:
        cause = SERIES_CAUSE.get(name)
        if cause and cause not in out:
            out.append(cause)
    return out


def _rel(t: float | None, t0: float | None) -> float | None:
    return None if t is None or t0 is None else round(t - t0, 1)


def build_row(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON row of one scenario from what `runner._drive` collected."""
    scenario, run = raw["scenario"], raw["run"]
    c = raw["counts"]
    t0 = run.fault_at
    incidents = [
        {
            "alertname": i["alertname"],
            "severity": i["severity"],
            "starts_at_s": _rel(i.get("starts_at"), t0),
            "causes": ranked_causes(i)[:3],
            "cause_scores": [
                {"cause": x["cause"], "score": x["score"]} for x in (i.get("causes") or [])[:3]
            ],
            "top_metrics": (i.get("top_metrics") or [])[:5],
            "prometheus": i.get("prometheus"),
        }
        for i in raw["incidents"]
        if i.get("status", "firing") == "firing" or i.get("resolved_at")
    ]
    incidents.sort(key=lambda i: (i["starts_at_s"] is None, i["starts_at_s"] or 0))
    # alerts that began before the fault are false alarms of the baseline, not the fault's
    before = [i for i in incidents if i["starts_at_s"] is not None and i["starts_at_s"] < 0]
    after = [i for i in incidents if i not in before]
    predicted = (after[0]["causes"] or ["(none ranked)"])[0] if after else None
    alerts = sorted(
        (
            {"alertname": a["alertname"], "severity": a["severity"], "at_s": _rel(a["at"], t0)}
            for a in run.alerts.values()
        ),
        key=lambda a: a["at_s"] if a["at_s"] is not None else math.inf,
    )
    phases = {}
    for p in run.phases:
        good = run.outcomes(p.name)
        phases[p.name] = {
            "start_s": round(p.start, 1),
            "end_s": None if p.end is None else round(p.end, 1),
            "requests": len(good),
            "ttft_p50_ms": latency_ms(good, "ttft", 50),
            "ttft_p99_ms": latency_ms(good, "ttft", 99),
            "tpot_p50_ms": latency_ms(good, "tpot", 50),
        }
    row: dict[str, Any] = {
        "name": scenario.name,
        "cause": scenario.cause,
        "sent": c["sent"],
        "completed": c["completed"],
        "rejected_429": c["rejected_429"],
        "failed": c["failed"],
        "lost": c["lost"],
        "5xx": c["5xx"] + run.extra.get("malformed_5xx", 0),
        "disconnected": c["disconnected"],
        **raw["latency"],
        "peak_rss_mb": raw["peak_rss_mb"],
        "alerts": alerts,
        "incidents": incidents,
        "predicted_cause": predicted,
        "correct": None if scenario.cause is None else predicted == scenario.cause,
        "false_alerts": len(incidents) if scenario.cause is None else len(before),
        "invariants": run.checks,
        "invariants_ok": all(v["ok"] for v in run.checks.values()),
        "phases": phases,
        "profile": raw["profile"],
        **run.extra,
    }
    if raw["restarts"]:
        row["restarts"] = raw["restarts"]
    return row


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Precision, recall and F1 of the webhook's top cause over the alerting scenarios;
    false alerts in the others."""
    tp = fp = fn = 0
    false_alerts = 0
    for r in rows:
        false_alerts += r["false_alerts"]
        if r["cause"] is None:
            fp += 1 if r["false_alerts"] else 0
        elif r["predicted_cause"] is None:
            fn += 1
        elif r["predicted_cause"] == r["cause"]:
            tp += 1
        else:
            fp += 1
            fn += 1
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "f1": round(f1, 3),
        "precision": round(precision, 3),
        "recall": round(recall, 3),
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "false_alerts": false_alerts,
    }


def write_results(rows: list[dict[str, Any]], path: Path = RESULTS, **meta: Any) -> dict[str, Any]:
    """bench/results/scenarios.json: {"date", "cpu", "f1", ..., "scenarios": rows}; rows of
    scenarios not run this time (e.g. the soak) are kept from the previous file."""
    previous: list[dict[str, Any]] = []
    if path.is_file():
        try:
            previous = json.loads(path.read_text()).get("scenarios", [])
        except ValueError:
            previous = []
    names = {r["name"] for r in rows}
    merged = rows + [r for r in previous if r["name"] not in names]
    s = score(merged)
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
        "cpu": cpu_name(),
        "f1": s["f1"],
        **{k: v for k, v in s.items() if k != "f1"},
        **meta,
        "scenarios": merged,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(doc: dict[str, Any]) -> str:
    """The results as a Markdown table (bench/NOTES.md)."""
    head = (
        "| scenario | truth | sent | ok | 429 | failed | lost | 5xx | TTFT p50/p99 ms | "
        "TPOT p50/p99 ms | peak RSS MB | alerts (s after fault) | webhook top cause | invariants |"
    )
    lines = [head, _sep(head)]
    for r in doc["scenarios"]:
        alerts = ", ".join(
            f"{a['alertname'].removeprefix('Moeserve')}/{a['severity'][0]} {a['at_s']}"
            for a in r["alerts"]
        )
        verdict = r["predicted_cause"] or "(no incident)"
        if r["cause"] is not None:
            verdict += " ✓" if r["correct"] else " ✗"
        elif r["false_alerts"]:
            verdict += f" ({r['false_alerts']} false)"
        bad = [k for k, v in r["invariants"].items() if not v["ok"]]
        lines.append(
            f"| {r['name']} | {r['cause'] or 'none'} | {r['sent']} | {r['completed']} | "
            f"{r['rejected_429']} | {r['failed']} | {r['lost']} | {r['5xx']} | "
            f"{_ms(r['ttft_p50_ms'])}/{_ms(r['ttft_p99_ms'])} | "
            f"{_ms(r['tpot_p50_ms'])}/{_ms(r['tpot_p99_ms'])} | {r['peak_rss_mb']:.0f} | "
            f"{alerts or '-'} | {verdict} | {'ok' if not bad else 'FAIL: ' + ', '.join(bad)} |"
        )
    return "\n".join(lines)


def _sep(head: str) -> str:
    return "|" + "|".join(" --- " for _ in range(head.count("|") - 1)) + "|"
