"""bench/replicas_bench.py (issue 36) end to end on the tiny model, --quick (a function check, no
timing asserted): two real replicas, the real vllm-router per policy, the sticky oracle, the kill
run; the result has every arm, hits counted by the replicas' own prefix-cache counters, and the
kill run's accounting adds up. Also the workload's shape and the kill report's arithmetic on
hand-made turns."""

from __future__ import annotations

import json

import pytest

from bench.chat_workload import Turn, Workload, system_prompt, user_messages
from bench.replicas import ROUTER
from bench.replicas_bench import POLICIES, QUICK, main, sticky_share, summary


def test_conversations_share_a_system_prompt_and_an_arm_salts_its_own():
    w = Workload(conversations=3, turns=2, user_words=20, system_words=6)
    assert system_prompt(w, "a") == system_prompt(w, "a") != system_prompt(w, "b")
    first, second = user_messages(w, "a", 0), user_messages(w, "a", 1)
    assert len(first) == 2 and all(len(m.split()) == 20 for m in first)
    assert first != second and first == user_messages(w, "a", 0)
    assert first != user_messages(w, "b", 0)


def _turn(c, k, ok=True, ttft=0.1):
    return Turn(c, k, f"x-c{c}-t{k}", "u", sent=float(k), ttft=ttft if ok else None,
                completion_tokens=4 if ok else 0, outcome="ok" if ok else "aborted")  # fmt: skip


def test_summary_and_sticky_share_count_what_they_say():
    turns = [_turn(0, 0), _turn(0, 1), _turn(0, 2), _turn(1, 0), _turn(1, 1, ok=False)]
    s = summary(turns, wall_s=2.0)
    assert (s["requests"], s["ok"], s["failed"], s["output_tokens"]) == (5, 4, 1, 16)
    assert s["output_tokens_per_s"] == 8.0 and s["ttft_p50_s"] == pytest.approx(0.1)
    where = {"x-c0-t0": 0, "x-c0-t1": 0, "x-c0-t2": 1, "x-c1-t0": 1, "x-c1-t1": 1}
    assert sticky_share(turns, where) == pytest.approx(2 / 3)  # c0: 0->0 yes, 0->1 no; c1 yes


@pytest.mark.slow
@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing")
def test_the_quick_bench_runs_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "replicas_bench.json"
    args = ["--quick", "--model", str(tiny_model_dir), "--dtype", "float32"]
    assert main([*args, "--kv-cache-tokens", "4096", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["arms"]) == ["oracle", *POLICIES]
    assert result["workload"]["conversations"] == QUICK.conversations
    for name, arm in result["arms"].items():
        assert arm["requests"] == QUICK.requests and arm["failed"] == 0, name
        # every admitted prompt token is queried once (no preemption in a roomy cache)
        assert arm["prefix_cache_queries"] == arm["prompt_tokens"], name
        assert 0 <= arm["prefix_cache_hits"] <= arm["prefix_cache_queries"]
        assert sum(r["requests"] for r in arm["per_replica"]) == QUICK.requests, name
        # paced: CPU time over wall x cores, each replica on its own core
        assert 0 < arm["cores_busy"] <= 1.1 and arm["not_sent"] == 0, name
    # kv_aware had the routed chats' token ids rendered by the replicas: none refused (a
    # render slower than the router's 1 s budget on a loaded machine counts as unavailable)
    inputs = {
        k.split('result="')[1].split('"')[0]: v
        for k, v in result["arms"]["kv_aware"]["router"].items()
        if k.startswith("vllm_router_kv_routing_inputs_total")
    }
    assert set(inputs) <= {"render", "preparation_unavailable"}, inputs
    assert sum(inputs.values()) == 2 * QUICK.requests and inputs["render"] >= QUICK.requests
    oracle = result["arms"]["oracle"]
    # each later turn repeats its conversation's earlier prompt on the same replica: it hits
    assert oracle["sticky_share"] == 1.0 and oracle["prefix_cache_hits"] > 0
    assert set(result["share_of_oracle_hits"]) == set(POLICIES)
    kill = result["kill"]
    assert kill["killed"] and kill["requests"] == QUICK.requests
    flight = kill["in_flight_on_dead"]
    assert sum(flight["outcomes"].values()) == flight["requests"]
    lost_on_dead = flight["requests"] - flight["outcomes"].get("ok", 0)
    assert kill["failed"] == lost_on_dead + kill["lost_not_reached_dead"]
    # each in-flight turn is classified: retried and OK, a clean error, aborted (the client
    # raised: its exception types counted) or truncated
    assert set(flight["outcomes"]) <= {"ok", "http_error", "stream_error", "aborted", "truncated"}
    parts = ("retried_ok", "clean_errors", "aborted", "truncated")
    assert sum(flight[k] for k in parts) == flight["requests"]
    assert sum(flight["exceptions"].values()) == flight["aborted"]
    assert kill["sent_after_kill_ok_on_survivor"] <= kill["sent_after_kill"]
