"""From scored series to ranked causes.

A latency or queue alert says what hurts; the operator needs what changed. The key series
are of two kinds:

- drivers: series that move *first* when a given cause is at work, and that the other
  causes do not move in the same direction: the arrival rate (more requests), the mean
  prompt length (bigger prefills), the engine's step time per sequence of the batch (the
  same work running slower: a noisy neighbour, throttling, a slower device), preemptions
  and KV usage (the KV cache exhausted), dropped spans (the trace exporter), the target's
  scrape health and the server-error ratio (the engine or the process gone), the last
  start's duration (a restart that took longer);
- consequences: TTFT, TPOT, e2e latency, queue time, waiting and running requests, token
  throughput, the cost per million tokens (price over throughput). They move under nearly
  every cause (a full KV cache, a long-prompt surge and a burst all fill the waiting queue),
  so they name a cause only when no driver moved.

Each cause scores the strongest move of its drivers in their own direction (the series'
robust z against its reference stretch, see detector.py); causes rank by that score.
When no driver passes the threshold, the waiting queue and queue time stand in for
"queue" (saturation without a visible reason), TPOT for "step_time" and the cost per
million tokens for "cost", at a discount.
Pure functions of `MetricScore`s: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schemas import CauseScore, MetricScore

# consequences stand in for a cause at this fraction of their score (when no driver moved)
FALLBACK_WEIGHT = 0.5


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    summary: str
    drivers: tuple[tuple[str, str], ...]  # (series, the direction that implicates the cause)
    fallback: tuple[tuple[str, str], ...] = ()


CAUSES: tuple[Cause, ...] = (
    Cause(
        "engine",
        "the server or its engine core went away (scrape failed, server errors)",
        (("target_up", "down"), ("error_ratio", "up")),
    ),
    Cause(
        "trace_export",
        "the trace exporter is losing spans (collector down, slow or refusing)",
        (("spans_dropped_per_second", "up"),),
    ),
    Cause(
        "kv_cache",
        "the KV cache is exhausted: sequences are preempted and recomputed",
        (("preemptions_per_second", "up"), ("kv_cache_usage_ratio", "up")),
    ),
    Cause(
        "prefill",
        "prompts got longer: prefill takes the engine's time and first tokens wait",
        (("prompt_tokens_per_request", "up"),),
    ),
    Cause(
        "step_time",
        "engine steps got slower for the same batch (CPU contention, throttling, device)",
        (("step_seconds_per_sequence", "up"),),
        (("tpot_p95_seconds", "up"),),
    ),
    Cause(
        "queue",
        "more requests arrive than the server completes: the waiting queue fills",
        (("arrival_rate", "up"),),
        (("requests_waiting", "up"), ("queue_time_p95_seconds", "up")),
    ),
    Cause(
        "startup",
        "a server restarted and its start took longer: capacity was missing meanwhile "
        "(moeserve_startup_phase_seconds and the startup trace say which phase)",
        (("startup_seconds", "up"),),
    ),
    Cause(
        "cost",
        "each token costs more: less is served for the configured --cost-per-hour",
        (),
        (("cost_per_million_tokens", "up"),),
    ),
    Cause(
        "expert_imbalance",
        "one expert takes most of the routed tokens: its MoE layer runs at that expert's pace",
        (("expert_imbalance", "up"),),
    ),
)


def _moved(score: MetricScore | None, direction: str, threshold: float) -> float:
    if score is None or score.status != "ok" or score.direction != direction:
        return 0.0
    return score.score if score.score >= threshold else 0.0


def rank_causes(
    scores: list[MetricScore], threshold: float, causes: tuple[Cause, ...] = CAUSES
) -> list[CauseScore]:
    """The causes whose drivers (or, when no driver moved, fallbacks) moved, best first."""
    by_name = {m.name: m for m in scores}
    ranked: list[CauseScore] = []
    for cause in causes:
        hits = [
            (name, _moved(by_name.get(name), direction, threshold))
            for name, direction in cause.drivers
        ]
        hits = [(n, s) for n, s in hits if s > 0]
        if hits:
            best = max(s for _, s in hits)
            evidence = [n for n, _ in sorted(hits, key=lambda h: -h[1])]
            ranked.append(
                CauseScore(
                    cause=cause.name, score=round(best, 3), summary=cause.summary, evidence=evidence
                )
            )
    if not ranked:
        for cause in causes:
            hits = [
                (name, _moved(by_name.get(name), direction, threshold))
                for name, direction in cause.fallback
            ]
            hits = [(n, s) for n, s in hits if s > 0]
            if hits:
                best = FALLBACK_WEIGHT * max(s for _, s in hits)
                evidence = [n for n, _ in sorted(hits, key=lambda h: -h[1])]
                ranked.append(
                    CauseScore(
                        cause=cause.name,
                        score=round(best, 3),
                        summary=cause.summary,
                        evidence=evidence,
                        inferred=True,
                    )
                )
    ranked.sort(key=lambda c: c.score, reverse=True)
    return ranked
