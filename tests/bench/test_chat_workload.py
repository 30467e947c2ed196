"""bench/chat_workload.py against a real server (tiny model): paced arrivals start each
conversation on its schedule and each next turn a think time after the reply; the closed loop
starts them all at once; max_wall_s stops a run, recording what it never sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.chat_workload import Workload, run_conversations
from bench.harness import InProcessServer
from tests.service.conftest import make_settings

SMALL = {"turns": 2, "user_words": 8, "system_words": 4, "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[InProcessServer]:
    with InProcessServer(make_settings(tiny_model_dir)) as srv:
        yield srv


def _run(server: InProcessServer, workload: Workload):
    model, url = server.state.model_name, server.url
    return asyncio.run(run_conversations(workload, model, lambda c, k: url, salt="t"))


def test_paced_conversations_start_on_schedule_and_think_between_turns(server):
    w = Workload(conversations=3, arrival_interval_s=0.3, think_time_s=0.2, **SMALL)
    turns, wall = _run(server, w)
    assert len(turns) == w.requests and all(t.ok for t in turns)
    by = {(t.conversation, t.turn): t for t in turns}
    for c in range(3):
        first, second = by[(c, 0)], by[(c, 1)]
        assert first.sent >= c * 0.3  # not before its start
        assert first.sent < c * 0.3 + 0.5  # nor long after: it does not wait for the others
        assert second.sent >= first.sent + first.e2e + 0.2  # the reply, then the think time
    assert wall >= 2 * 0.3


def test_closed_loop_starts_every_conversation_at_once(server):
    w = Workload(conversations=3, arrival_interval_s=None, think_time_s=5.0, **SMALL)
    turns, _ = _run(server, w)
    firsts = [t.sent for t in turns if t.turn == 0]
    assert max(firsts) < 0.5 and all(t.ok for t in turns)
    by = {(t.conversation, t.turn): t for t in turns}
    # no think time in a closed loop: the next turn follows its reply at once
    assert all(by[(c, 1)].sent - (by[(c, 0)].sent + by[(c, 0)].e2e) < 1.0 for c in range(3))


def test_max_wall_stops_the_run_and_records_what_was_not_sent(server):
    w = Workload(conversations=3, arrival_interval_s=5.0, max_wall_s=1.0, **SMALL)
    turns, wall = _run(server, w)
    assert wall < 3.0 and len(turns) == w.requests
    outcomes = {(t.conversation, t.turn): t.outcome for t in turns}
    assert outcomes[(0, 0)] == "ok"
    assert outcomes[(1, 0)] == outcomes[(2, 0)] == outcomes[(2, 1)] == "not_sent"
