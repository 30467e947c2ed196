"""`make bench`, routing across replicas (issue 36): 2 `moeserve serve` replicas x 1 core behind
vLLM's router (bench/replicas.py), on a multi-turn chat workload (bench/chat_workload.py: many
conversations in flight, a short common system prompt, each turn adding a few hundred tokens to
its own history). One arm per router policy (round_robin, cache_aware, kv_aware), each with a
router of its own in front of the same two replicas, compared on:

  - prefix-cache hit ratio, from our metrics: vllm:prefix_cache_hits_total / _queries_total
    (tokens) scraped from each replica's /metrics before and after the arm;
  - TTFT p50 / p99 (first streamed token, as the client sees it through the router), also
    over the turns after a conversation's first (those a cache can serve);
  - throughput (output tokens and requests per second over the arm's wall time);
  - the share of the replicas' cores busy over the arm (their processes' CPU time, API and
    engine core, over wall time x cores), per replica and together: a paced arm well below 1
    measures routing, not queueing.

Arrivals are paced by default (chat_workload: conversations start on a fixed schedule, each
next turn after a think time), so TTFT shows what a cache hit saves rather than the queue
behind every other conversation's prefill; --closed-loop sends every conversation at once.
If an arm's cores are busy near 1, its TTFT is queueing again: raise --arrival-interval.
The router's own view of each arm is kept too: its vllm_router_kv_* and prefix-routing
counters (for kv_aware: whether the replicas rendered each request's tokens, index hits).

The oracle arm runs the same workload with every turn on the replica that served its
conversation's previous turn (conversation c on replica c % 2, addressed directly, no router):
the hits sticky placement gets within the cache's capacity, measured rather than computed. Each
policy's hits are reported as a share of the oracle's. Where each turn ran comes from the
replicas' inspectors (the x-request-id the client sent; the router passes it on).

The replicas stay up across arms (a start costs more than an arm on the demo model), so each arm
draws its own conversations and system prompt (chat_workload's salt): no arm finds another's
blocks in a cache but those wholly before the salted words (the chat template's opening and
"You are a terse assistant.": the first block with the demo tokenizer), and a cache holding
an earlier arm's blocks only has free, evictable blocks. A warm-up request per replica runs
first. kv_aware's router, started for its arm, learns what the replicas cached before it
(that block, which every later block chains onto) from their replay sockets; its
`arms.kv_aware.router` counters show index hits and misses.

Then the kill run: a router (--kill-policy) in front of both, the same kind of workload, and
once --kill-after of its turns have finished, replica 1 (its API process and engine core) gets
SIGKILL. Recorded: what the router did (its /workers view, polled, and its log lines naming the
dead replica), requests lost, split into those in flight on the dead replica (its inspector's
in-progress requests just before the kill) and those that had not reached it, how each in-flight
one ended (`kill.in_flight_on_dead`: retried by the router and OK; a clean error, an HTTP error
status or an SSE error event; aborted, the connection closed mid-body and the client raised, by
exception type; truncated, ended quietly short of its finish_reason and [DONE]), and the time
from the kill until the survivor carries everything (every turn sent from then on succeeds).
vllm-router 0.1.17 aborts: a replica's death mid-stream reaches the client as a chunked body
without its last chunk (tests/service/test_router_replica_kill.py).

Writes --out (default bench/results/replicas_bench.json) and prints the table for
bench/NOTES.md. --quick: a small workload for a smoke test (tests/bench/test_replicas_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.chat_workload import Turn, Workload, run_conversations
from bench.machine import cpu_name
from bench.replicas import ROUTER, Replica, replicas, start_router
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).resolve().parent / "results" / "replicas_bench.json"
POLICIES = ("round_robin", "cache_aware", "kv_aware")
QUICK = Workload(
    conversations=4, turns=3, user_words=40, system_words=12, max_tokens=4,
    arrival_interval_s=0.3, think_time_s=0.2, max_wall_s=180.0,
)  # fmt: skip
ROUTER_SERIES = ("vllm_router_kv_", "vllm_router_prefix_routing_decisions")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
CLEAN = ("http_error", "stream_error")  # failed turns' outcomes the target calls a clean error


# ---- what the replicas report -------------------------------------------------------------
def prefix_cache_counters(url: str) -> dict[str, float]:
    """A replica's prefix-cache counters (tokens) off its /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (HITS, QUERIES):
                found[sample.name] = sample.value
    return {"hits": found[HITS], "queries": found[QUERIES]}


def inspected(url: str) -> list[dict]:
    """The requests a replica's inspector recorded (newest first)."""
    return httpx.get(url + "/inspect/api/requests", timeout=30).json()["requests"]


def replica_cpu_seconds(replica: Replica) -> float:
    """CPU time (user + system) its API process and engine core have used so far."""
    total = 0
    for pid in (replica.server.pid, replica.server.engine_core_pid()):
        if pid is None:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone (the kill run)
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / _CLOCK_TICKS


def router_counters(metrics_url: str) -> dict[str, float]:
    """The router's own routing counters ("name{labels}" -> value) off its /metrics."""
    text = httpx.get(metrics_url, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(ROUTER_SERIES):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def placement(workers: Sequence[Replica], turns: list[Turn], dead: dict | None = None) -> dict:
    """request id -> index of the replica that recorded it; `dead` {index: its records taken
    before it died} stands in for a replica that cannot be asked any more."""
    ids = {t.request_id for t in turns}
    where: dict[str, int] = {}
    for i, replica in enumerate(workers):
        records = (dead or {}).get(i)
        for record in records if records is not None else inspected(replica.server.url):
            if record["request_id"] in ids:
                where[record["request_id"]] = i
    return where


def sticky_share(turns: list[Turn], where: dict[str, int]) -> float | None:
    """Of the turns after a conversation's first, the share that ran on the replica that ran
    the conversation's previous turn (the oracle's is 1)."""
    by_key = {(t.conversation, t.turn): where.get(t.request_id) for t in turns}
    pairs = [
        (by_key[(c, k - 1)], here)
        for (c, k), here in by_key.items()
        if k > 0 and here is not None and by_key.get((c, k - 1)) is not None
    ]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


# ---- one arm ----------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(turns: list[Turn], wall_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    later = [t.ttft for t in ok if t.ttft is not None and t.turn > 0]
    tokens = sum(t.completion_tokens for t in ok)
    return {
        "requests": len(turns),
        "ok": len(ok),
        "failed": len(turns) - len(ok),
        "not_sent": sum(t.outcome == "not_sent" for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "ttft_later_turns_p50_s": _percentile(later, 50),
        "ttft_later_turns_p99_s": _percentile(later, 99),
        "output_tokens_per_s": tokens / wall_s if wall_s else None,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
    }


def run_arm(
    workers: Sequence[Replica],
    workload: Workload,
    model: str,
    salt: str,
    target,
    router_metrics: str | None = None,
) -> dict:
    """The workload with turns sent where `target(c, k)` says; hits from each replica's
    counters, busy cores from their CPU time, and (`router_metrics`) the router's counters."""
    before = [prefix_cache_counters(r.server.url) for r in workers]
    routed_before = router_counters(router_metrics) if router_metrics else {}
    cpu_before = [replica_cpu_seconds(r) for r in workers]
    turns, wall = asyncio.run(run_conversations(workload, model, target, salt=salt))
    cpu = [replica_cpu_seconds(r) - b for r, b in zip(workers, cpu_before, strict=True)]
    after = [prefix_cache_counters(r.server.url) for r in workers]
    per_replica = [
        {k: a[k] - b[k] for k in ("queries", "hits")} for a, b in zip(after, before, strict=True)
    ]
    hits = sum(r["hits"] for r in per_replica)
    queries = sum(r["queries"] for r in per_replica)
    where = placement(workers, turns)
    return {
        **summary(turns, wall),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_ratio": hits / queries if queries else None,
        "per_replica": [
            {
                **r,
                "hit_ratio": r["hits"] / r["queries"] if r["queries"] else None,
                "requests": sum(1 for i in where.values() if i == n),
                "cores_busy": cpu[n] / (wall * len(workers[n].cpus)),
            }
            for n, r in enumerate(per_replica)
        ],
        "cores_busy": sum(cpu) / (wall * sum(len(r.cpus) for r in workers)),
        "sticky_share": sticky_share(turns, where),
        "router": _counter_deltas(router_counters(router_metrics), routed_before)
        if router_metrics
        else None,
    }


def _counter_deltas(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


# ---- the kill run -----------------------------------------------------------------------------
def _kill(replica: Replica) -> None:
    """SIGKILL to the replica's API process and its engine core: the whole replica at once."""
    core = replica.server.engine_core_pid()
    for pid in (replica.server.pid, core):
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _kill_run(
    workers: Sequence[Replica], router_url: str, workload: Workload, model: str, kill_after: float
) -> dict:
    doomed = workers[1]
    done = asyncio.Event()
    finished = 0
    threshold = max(1, int(kill_after * workload.requests))
    state: dict = {}
    views: list[tuple[float, list[str]]] = []  # (seconds from the kill, healthy workers) changes

    def on_turn(_: Turn) -> None:
        nonlocal finished
        finished += 1
        if finished >= threshold:
            done.set()

    async def killer(t0: float) -> None:
        await done.wait()
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(doomed.server.url + "/inspect/api/requests")
        state["records"] = response.json()["requests"]  # the last word of the doomed replica
        _kill(doomed)
        state["kill_at"] = time.perf_counter() - t0
        state["killed"] = time.monotonic()

    async def watch_router() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            last = None
            while not state.get("finished"):
                try:
                    workers_now = (await client.get(router_url + "/workers")).json()["workers"]
                    healthy = sorted(w["url"] for w in workers_now if w.get("is_healthy"))
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    healthy = [f"unreadable: {exc!r}"]
                if healthy != last and "killed" in state:
                    views.append((time.monotonic() - state["killed"], healthy))
                last = healthy
                await asyncio.sleep(0.25)

    async def load() -> tuple[list[Turn], float]:
        t0 = time.perf_counter()
        kill = asyncio.ensure_future(killer(t0))
        try:
            turns, wall = await run_conversations(
                workload, model, lambda c, k: router_url, salt="kill", on_turn=on_turn
            )
        finally:
            state["finished"] = True
        if not kill.done():  # fewer turns than the threshold finished: kill never came
            kill.cancel()
        return turns, wall

    turns, wall = (await asyncio.gather(load(), watch_router()))[0]
    return {"turns": turns, "wall_s": wall, "router_views": views, **state}


def kill_report(run: dict, workers: Sequence[Replica], router_log: str) -> dict:
    """What the kill run shows: the router's view, the requests lost and how they ended."""
    turns: list[Turn] = run["turns"]
    if "kill_at" not in run:
        return {"killed": False, **summary(turns, run["wall_s"])}
    kill_at, dead_url = run["kill_at"], workers[1].server.url
    in_flight = {r["request_id"] for r in run["records"] if r["outcome"] == "in_progress"}
    on_dead = [t for t in turns if t.request_id in in_flight]
    lost_elsewhere = [t for t in turns if not t.ok and t.request_id not in in_flight]
    after = sorted((t for t in turns if t.sent >= kill_at), key=lambda t: t.sent)
    failed_after = [i for i, t in enumerate(after) if not t.ok]
    if not failed_after:
        carries_all = 0.0
    elif failed_after[-1] + 1 < len(after):
        carries_all = after[failed_after[-1] + 1].sent - kill_at
    else:
        carries_all = None  # failures to the end of the run
    where = placement(workers, turns, dead={1: run["records"]})
    survivor_after = sum(where.get(t.request_id) == 0 for t in after if t.ok)
    # what the router said about the dead replica once serving: its warnings and errors naming
    # it, and whatever it logged about retries, its circuit breaker or worker health
    plain = [_ANSI.sub("", line).strip() for line in router_log.splitlines()]
    dead_lines = [
        line
        for line in plain
        if (dead_url in line and re.search(r"\b(WARN|ERROR)\b", line))
        or re.search(r"circuit|retry|retries|unhealthy", line, re.IGNORECASE)
    ]
    return {
        "killed": True,
        "kill_at_s": kill_at,
        "dead_replica": dead_url,
        **summary(turns, run["wall_s"]),
        "in_flight_on_dead": {
            "requests": len(on_dead),
            "outcomes": _count(t.outcome for t in on_dead),
            # ended OK all the same: the router sent it again elsewhere (its response head had
            # not left the dead replica, so the router's send failed and it retried)
            "retried_ok": sum(t.ok for t in on_dead),
            # an HTTP error status or an SSE error event: what the target calls clean
            "clean_errors": sum(t.outcome in CLEAN for t in on_dead),
            # the 200 head was out; the router closed the connection mid-body (vllm-router
            # 0.1.17 on an upstream body error) and the client raised: these exception types
            "aborted": sum(t.outcome == "aborted" for t in on_dead),
            "exceptions": _count(t.exception for t in on_dead if t.exception),
            # ended without raising but short of its finish_reason / [DONE]: a client sees it
            # only by the framing (every whole stream of ours has both)
            "truncated": sum(t.outcome == "truncated" for t in on_dead),
            "failed_without_finish_reason": sum(
                not t.ok and t.finish_reason is None for t in on_dead
            ),
            "failed_after_tokens": sum(not t.ok and t.got_tokens for t in on_dead),
            "statuses": _count(str(t.status) for t in on_dead if not t.ok),
            "errors": sorted({t.error for t in on_dead if t.error})[:5],
        },
        "lost_not_reached_dead": len(lost_elsewhere),
        "lost_not_reached_dead_outcomes": _count(t.outcome for t in lost_elsewhere),
        "lost_not_reached_dead_statuses": _count(str(t.status) for t in lost_elsewhere),
        "lost_not_reached_dead_errors": sorted({t.error for t in lost_elsewhere if t.error})[:5],
        "sent_after_kill": len(after),
        "sent_after_kill_ok_on_survivor": survivor_after,
        "survivor_carries_all_after_s": carries_all,
        # the router's /workers view: each change after the kill (none: it still listed the
        # dead replica as healthy when the run ended)
        "router_healthy_workers_after_kill": [
            {"at_s": at, "healthy": healthy} for at, healthy in run["router_views"]
        ],
        "router_log_lines_on_dead": len(dead_lines),
        "router_log_excerpt": dead_lines[:3] + dead_lines[-3:]
        if len(dead_lines) > 6
        else dead_lines,
    }


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


# ---- the whole bench --------------------------------------------------------------------------
def _pin_replicas_to(cores: int) -> tuple[set[int], set[int]]:
    """(the cores the replicas get: the first `cores` of ours, the rest: the client's and the
    routers'; all of them when there are no more)."""
    ours = sorted(os.sched_getaffinity(0))
    replica_cores = set(ours[:cores])
    return replica_cores, set(ours[cores:]) or set(ours)


def _served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_bench(
    model_dir: str,
    workload: Workload,
    *,
    policies: Sequence[str] = POLICIES,
    kill_policy: str | None = "cache_aware",
    kill_after: float = 0.4,
    kv_cache_tokens: int = 16384,
    max_model_len: int = 4096,
    dtype: str = "auto",
    cores_per_replica: int = 1,
) -> dict:
    serve_args = [
        "--kv-cache-tokens", kv_cache_tokens, "--max-model-len", max_model_len,
        "--dtype", dtype, "--inspector-requests", 4 * workload.requests * (len(policies) + 3),
    ]  # fmt: skip
    serve_args = [str(a) for a in serve_args]
    replica_cores, client_cores = _pin_replicas_to(2 * cores_per_replica)
    ours = os.sched_getaffinity(0)
    os.sched_setaffinity(0, replica_cores)  # replicas() splits this process's cores
    arms: dict[str, dict] = {}
    try:
        # the router replicas() starts stays idle (and pinned with the replicas): each arm
        # starts its own, off the replicas' cores
        with replicas(model_dir, 2, "round_robin", serve_args=serve_args) as cluster:
            os.sched_setaffinity(0, client_cores)
            workers = cluster.replicas
            model = _served_model(workers[0].server.url)
            warm = Workload(conversations=2, turns=1, user_words=8, max_tokens=2)
            asyncio.run(
                run_conversations(warm, model, lambda c, k: workers[c].server.url, salt="warm")
            )
            arms["oracle"] = run_arm(
                workers, workload, model, "oracle", lambda c, k: workers[c % 2].server.url
            )
            for policy in policies:
                router, url, metrics = start_router(workers, model_dir, policy)
                try:
                    arms[policy] = run_arm(
                        workers, workload, model, policy, lambda c, k, url=url: url, metrics
                    )
                finally:
                    router.stop()
            kill = None
            if kill_policy is not None:
                router, url, _ = start_router(workers, model_dir, kill_policy)
                try:
                    run = asyncio.run(_kill_run(workers, url, workload, model, kill_after))
                finally:
                    router.stop()
                kill = {"policy": kill_policy, **kill_report(run, workers, router.log_text())}
    finally:
        os.sched_setaffinity(0, ours)
    oracle_hits = arms["oracle"]["prefix_cache_hits"]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": len(ours),
        "replicas": 2,
        "cores_per_replica": cores_per_replica,
        "model": Path(model_dir).name,
        "router": "vllm-router " + _router_version(),
        "workload": {
            **dataclasses.asdict(workload),
            "kv_cache_tokens": kv_cache_tokens,
            "dtype": dtype,
        },
        "arms": arms,
        "share_of_oracle_hits": {
            policy: arms[policy]["prefix_cache_hits"] / oracle_hits if oracle_hits else None
            for policy in policies
        },
        "kill": kill,
    }


def _router_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-router")
    except PackageNotFoundError:
        return "unknown"


def table(result: dict) -> str:
    """The NOTES.md table: one row per arm."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    def num(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    rows = [
        (
            "| arm | hit ratio | share of oracle hits | sticky | TTFT p50 ms | TTFT p99 ms "
            "| later turns TTFT p50 ms | output tok/s | req/s | cores busy | failed |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in result["arms"].items():
        share = 1.0 if name == "oracle" else result["share_of_oracle_hits"].get(name)
        rows.append(
            f"| {name} | {num(arm['hit_ratio'])} | {num(share)} | {num(arm['sticky_share'], '.2f')}"
            f" | {ms(arm['ttft_p50_s'])} | {ms(arm['ttft_p99_s'])}"
            f" | {ms(arm['ttft_later_turns_p50_s'])}"
            f" | {num(arm['output_tokens_per_s'], '.1f')} | {num(arm['requests_per_s'], '.2f')}"
            f" | {num(arm['cores_busy'], '.2f')} | {arm['failed']} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder (default: the demo model)")
    parser.add_argument("--preset", default="small", help="demo model size (without --model)")
    parser.add_argument("--quick", action="store_true", help="a small workload (smoke test)")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--user-words", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument(
        "--arrival-interval", type=float, help="seconds between conversation starts (paced)"
    )
    parser.add_argument("--think-time", type=float, help="seconds from a reply to the next turn")
    parser.add_argument(
        "--closed-loop", action="store_true", help="every conversation at once, no think time"
    )
    parser.add_argument("--max-wall", type=float, help="an arm stops here (seconds)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--kill-policy", default="cache_aware", help="'none': no kill run")
    parser.add_argument("--kill-after", type=float, default=0.4, help="share of turns done")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384, help="per replica")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not ROUTER.exists():
        parser.error("vllm-router is missing: pip install vllm-router (a dev dependency)")
    policies = tuple(p for p in args.policies.split(",") if p)
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    workload = QUICK if args.quick else Workload()
    overrides = {
        "conversations": args.conversations,
        "turns": args.turns,
        "user_words": args.user_words,
        "max_tokens": args.max_tokens,
    }
    workload = dataclasses.replace(workload, **{k: v for k, v in overrides.items() if v})
    pacing = {
        "arrival_interval_s": args.arrival_interval,
        "think_time_s": args.think_time,
        "max_wall_s": args.max_wall,
    }
    workload = dataclasses.replace(workload, **{k: v for k, v in pacing.items() if v is not None})
    if any(v is not None and v < 0 for v in pacing.values()):
        parser.error("--arrival-interval, --think-time and --max-wall must be >= 0")
    if args.closed_loop:
        workload = dataclasses.replace(workload, arrival_interval_s=None, think_time_s=0.0)
    model_dir = args.model or str(ensure_demo_model(args.preset))
    result = run_bench(
        model_dir,
        workload,
        policies=policies,
        kill_policy=None if args.kill_policy == "none" else args.kill_policy,
        kill_after=args.kill_after,
        kv_cache_tokens=args.kv_cache_tokens,
        dtype=args.dtype,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    if result["kill"]:
        k = result["kill"]
        flight = k.get("in_flight_on_dead", {})
        print(
            f"kill ({k['policy']}): in flight on the dead replica {flight.get('requests')} "
            f"(outcomes {flight.get('outcomes')}, client exceptions {flight.get('exceptions')}), "
            f"lost without reaching it {k.get('lost_not_reached_dead')}; details in {args.out}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
