"""A request's speculative-decoding acceptance in the inspector's summary (summed over its
samples), as its RequestTimes carry it."""

from __future__ import annotations

from types import SimpleNamespace

from inference.outputs import CompletionOutput, RequestTimes
from service.inspector.views import summary
from telemetry.requests import merged_times


def _record(times) -> SimpleNamespace:
    fields = dict.fromkeys(
        (
            "latencies",
            "response_id",
            "telemetry",
            "operation",
            "stream",
            "status",
            "code",
            "error",
            "finish_reason",
            "trace_id",
        ),
    )
    return SimpleNamespace(
        **fields,
        times=times,
        id="1",
        request_id="r",
        api="rest",
        key="none",
        started_at=0.0,
        outcome="ok",
        prompt_tokens=3,
        completion_tokens=8,
    )


def test_summary_shows_the_drafts_accepted_over_every_sample():
    samples = [
        CompletionOutput(
            i, times=RequestTimes(arrival=1.0, spec_draft_tokens=d, spec_accepted_tokens=a)
        )
        for i, (d, a) in enumerate([(8, 5), (4, 1)])
    ]
    row = summary(_record(merged_times(samples)), None)
    assert (row.spec_draft_tokens, row.spec_accepted_tokens) == (12, 6)
    one = summary(_record(merged_times(samples[:1])), None)
    assert (one.spec_draft_tokens, one.spec_accepted_tokens) == (8, 5)
    assert summary(_record(None), None).spec_draft_tokens == 0
