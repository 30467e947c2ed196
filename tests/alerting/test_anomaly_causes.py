"""The webhook's cause ranking (telemetry/anomaly/causes.py): drivers name the cause, the
consequences every cause shares (latency, queue) do not, unless no driver moved. Once over
synthetic scores, once through the Analyzer against a fake Prometheus whose series move as
they do in the fault scenarios (bench/scenarios)."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import parse_qs

import httpx
import numpy as np
import pytest

from telemetry.anomaly import WebhookSettings
from telemetry.anomaly.analyzer import KEY_SERIES, Analyzer
from telemetry.anomaly.causes import CAUSES, FALLBACK_WEIGHT, rank_causes
from telemetry.anomaly.prometheus_api import PrometheusAPI
from telemetry.anomaly.schemas import AlertmanagerAlert, MetricScore

THRESHOLD = 4.0
NOW = 1_700_000_000.0


def scores(**moves: float) -> list[MetricScore]:
    """name=z (negative: a move down)."""
    return [
        MetricScore(
            name=name,
            score=abs(z),
            direction="flat" if abs(z) < THRESHOLD else "up" if z > 0 else "down",
            reference=1.0,
            recent=1.0,
            peak=1.0,
        )
        for name, z in moves.items()
    ]


def top(moves: dict[str, float]) -> str:
    return rank_causes(scores(**moves), THRESHOLD)[0].cause


def test_every_driver_is_a_key_series():
    names = {ks.name for ks in KEY_SERIES}
    for cause in CAUSES:
        for series, direction in (*cause.drivers, *cause.fallback):
            assert series in names, (cause.name, series)
            assert direction in ("up", "down")


def test_a_full_kv_cache_is_named_though_the_queue_moved_more():
    # preempted sequences wait again: queue time explodes, arrivals fall (closed-loop clients)
    moves = {
        "queue_time_p95_seconds": 450, "ttft_p95_seconds": 80, "requests_waiting": 12,
        "preemptions_per_second": 40, "kv_cache_usage_ratio": 30, "arrival_rate": -6,
    }  # fmt: skip
    ranked = rank_causes(scores(**moves), THRESHOLD)
    assert [c.cause for c in ranked] == ["kv_cache"]
    assert ranked[0].evidence == ["preemptions_per_second", "kv_cache_usage_ratio"]
    assert ranked[0].score == 40 and not ranked[0].inferred


def test_longer_prompts_are_prefill_not_queue():
    moves = {
        "prompt_tokens_per_request": 90, "ttft_p95_seconds": 300, "queue_time_p95_seconds": 200,
        "requests_waiting": 20, "kv_cache_usage_ratio": 6, "tpot_p95_seconds": 50,
    }  # fmt: skip
    assert top(moves) == "prefill"


def test_a_burst_is_queue_though_steps_slowed_a_little():
    moves = {"arrival_rate": 95, "requests_waiting": 16, "step_seconds_per_sequence": 4.5}
    assert [c.cause for c in rank_causes(scores(**moves), THRESHOLD)] == ["queue", "step_time"]


def test_a_noisy_neighbour_is_step_time():
    moves = {"step_seconds_per_sequence": 30, "tpot_p95_seconds": 120, "arrival_rate": -8}
    assert top(moves) == "step_time"


def test_dropped_spans_and_a_down_target():
    assert top({"spans_dropped_per_second": 200}) == "trace_export"
    assert top({"target_up": -50, "error_ratio": 30, "arrival_rate": 5}) == "engine"


def test_a_move_in_the_other_direction_or_under_the_threshold_implicates_nothing():
    assert (
        rank_causes(scores(arrival_rate=-40, target_up=3, prompt_tokens_per_request=3.9), 4) == []
    )


def test_without_a_driver_the_consequences_stand_in_at_a_discount():
    ranked = rank_causes(scores(requests_waiting=10, queue_time_p95_seconds=30), THRESHOLD)
    assert [c.cause for c in ranked] == ["queue"]
    assert ranked[0].inferred and ranked[0].score == pytest.approx(FALLBACK_WEIGHT * 30)
    assert top({"tpot_p95_seconds": 20}) == "step_time"
    # a driver anywhere silences every fallback
    assert [
        c.cause for c in rank_causes(scores(requests_waiting=10, kv_cache_usage_ratio=5), 4)
    ] == ["kv_cache"]


# --- through the Analyzer -----------------------------------------------------------------

LABELS = {"job": "moeserve", "instance": "m:8000", "model": "demo"}


def fake_prometheus(moves: dict[str, float], onset: float) -> httpx.MockTransport:
    """Every key series is noise around a level of its own; those in `moves` are multiplied
    by that factor from `onset` on (target_up: set to the factor)."""
    by_query = {ks.query(LABELS, "1m"): ks.name for ks in KEY_SERIES}
    rng = np.random.default_rng(3)

    def handler(request: httpx.Request) -> httpx.Response:
        q = {k: v[0] for k, v in parse_qs(request.url.query.decode()).items()}
        if request.url.path == "/api/v1/query_exemplars":
            return httpx.Response(200, json={"status": "success", "data": []})
        name = by_query[q["query"]]
        start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
        ts = np.arange(start, end + 1e-6, step)
        if name in ("target_up",):
            values = np.ones(ts.size)
        elif name in ("preemptions_per_second", "spans_dropped_per_second", "requests_waiting"):
            values = np.zeros(ts.size)
        else:
            level = 1.0 + abs(hash(name)) % 5
            values = level * (1 + rng.normal(0, 0.03, ts.size))
        if name in moves:
            after = ts >= onset
            if name == "target_up" or not values[0]:
                values[after] = moves[name]
            else:
                values[after] *= moves[name]
        result = [
            {"metric": {}, "values": [[float(t), repr(float(v))] for t, v in zip(ts, values)]}
        ]
        return httpx.Response(
            200, json={"status": "success", "data": {"resultType": "matrix", "result": result}}
        )

    return httpx.MockTransport(handler)


SCENARIOS = {
    "queue": {"arrival_rate": 10, "requests_waiting": 16, "queue_time_p95_seconds": 30, "ttft_p95_seconds": 20},
    "prefill": {"prompt_tokens_per_request": 10, "ttft_p95_seconds": 40, "queue_time_p95_seconds": 20, "requests_waiting": 8},
    "step_time": {"step_seconds_per_sequence": 6, "tpot_p95_seconds": 8, "arrival_rate": 0.5},
    "kv_cache": {"preemptions_per_second": 3, "kv_cache_usage_ratio": 4, "requests_waiting": 6, "queue_time_p95_seconds": 50, "arrival_rate": 0.4},
    "trace_export": {"spans_dropped_per_second": 80},
    "engine": {"target_up": 0, "error_ratio": 5},
    "startup": {"startup_seconds": 5, "target_up": 1},
    "cost": {"cost_per_million_tokens": 4},
}  # fmt: skip


@pytest.mark.parametrize("cause", sorted(SCENARIOS))
async def test_the_analyzer_names_each_scenarios_cause(cause):
    onset = NOW - 300
    settings = WebhookSettings(prometheus_url="http://prom.test", isolation_forest=False)
    prom = PrometheusAPI("http://prom.test", transport=fake_prometheus(SCENARIOS[cause], onset))
    analyzer = Analyzer(settings, prom, clock=lambda: NOW)
    alert = AlertmanagerAlert(
        status="firing",
        labels={"alertname": "X", **LABELS},
        startsAt=datetime.fromtimestamp(onset + 60, tz=UTC),
    )
    incident = await analyzer.analyze(alert, NOW)
    await prom.aclose()
    assert incident.prometheus == "ok", incident.reason
    assert incident.causes and incident.causes[0].cause == cause, [
        (c.cause, c.score, c.evidence) for c in incident.causes
    ]
    target = next(m for m in incident.metrics if m.name == "target_up")
    assert 'model="demo"' not in target.query and 'instance="m:8000"' in target.query
