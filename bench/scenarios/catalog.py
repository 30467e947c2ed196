"""The scenarios: each a baseline of ordinary traffic, one fault, a recovery, and the
invariants it must keep. Ground-truth causes use the webhook's cause names
(telemetry/anomaly/causes.py): queue, prefill, step_time, kv_cache, trace_export, engine;
None for a scenario that should not alert.

Rates are fractions of the capacity measured on the run's first server (completed standard
requests per second at a full batch); durations come from the profile (baseline_s,
fault_s, recovery_s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

import httpx

from bench.harness import REPO
from bench.scenarios.faults import CpuHog, kill_engine_core
from bench.scenarios.load import latency_ms
from bench.scenarios.runner import API_KEY, Run, Scenario

BASE_LOAD = 0.3  # of capacity: an ordinary day
BURST = 10.0  # x capacity


async def _baseline(run: Run, rate: float, spec=None) -> None:
    async with run.phase("baseline"):
        await run.traffic.open_loop(rate, run.profile.baseline_s, spec or run.std, "baseline")


async def _recovery(run: Run, rate: float) -> None:
    async with run.phase("recovery"):
        await run.traffic.open_loop(rate, run.profile.recovery_s, run.std, "recovery")


def _common_checks(run: Run, *, allow_failed: bool = False) -> None:
    good = run.outcomes(kind=None)
    lost = [o for o in good if o.outcome == "lost"]
    run.check("none_lost", not lost, lost=len(lost), statuses=sorted({o.status for o in lost}))
    if not allow_failed:
        failed = [o for o in good if o.outcome == "failed"]
        run.check(
            "none_failed",
            not failed,
            failed=len(failed),
            errors=sorted({o.error for o in failed})[:5],
        )
    fives = sum(o.http_5xx for o in good) + run.extra.get("malformed_5xx", 0)
    run.check("no_5xx", fives == 0, count=fives)


# --- 1. arrival burst ------------------------------------------------------------------


async def arrival_burst(run: Run) -> None:
    cap = await run.capacity()
    await _baseline(run, BASE_LOAD * cap)
    async with run.phase("fault", fault=True):
        await run.traffic.open_loop(BURST * cap, run.profile.fault_s, run.std, "fault")
    await _recovery(run, BASE_LOAD * cap)
    await run.check_idle()
    _common_checks(run)
    refused = run.outcomes("fault")
    r429 = [o for o in refused if o.outcome == "rejected_429"]
    run.check("shed_with_429", bool(r429), rejected=len(r429))
    no_retry = [o for o in r429 if not o.retry_after]
    run.check("429_has_retry_after", not no_retry, missing=len(no_retry))
    run.extra["burst_rps"] = round(BURST * cap, 1)


# --- 2. long-prompt surge ----------------------------------------------------------------

LONG_PROMPT_FACTOR = 10
PREFILL_PROBE_TOKENS = 2048
SURGE_OVERLOAD = 1.5  # the fault's prefill tokens/s over what the server prefills alone
MAX_PROMPT_TOKENS = 4000  # under the small demo model's 4,096 positions, with the output


async def _prefill_rate(run: Run) -> float:
    """Prompt tokens/s this server prefills (one long prompt alone, its TTFT)."""
    best = 0.0
    for _ in range(2):  # the first pays for shapes it has not seen
        out = await run.traffic.one(run.traffic.spec(PREFILL_PROBE_TOKENS, 1), "probe", "probe")
        if out.ttft:
            best = max(best, PREFILL_PROBE_TOKENS / out.ttft)
    return best


async def long_prompt_surge(run: Run) -> None:
    """The fault's prompts are 10x the baseline's, at the baseline's arrival rate; the
    baseline's length is sized from this server's prefill rate so that the surge asks for
    SURGE_OVERLOAD times what it can prefill (a machine that prefills 10x faster gets 10x
    longer prompts: the same fault everywhere, not a surge a fast CPU absorbs unnoticed)."""
    cap = await run.capacity()
    rate = BASE_LOAD * cap
    p = run.profile
    prefill_tps = await _prefill_rate(run)
    wanted = SURGE_OVERLOAD * prefill_tps / (rate * LONG_PROMPT_FACTOR)
    base = int(min(max(wanted, p.prompt_tokens), MAX_PROMPT_TOKENS // LONG_PROMPT_FACTOR))
    run.extra |= {"prefill_tokens_per_s": round(prefill_tps), "baseline_prompt_tokens": base}

    def short() -> object:
        return run.traffic.spec(base, p.output_tokens)

    def long() -> object:
        return run.traffic.spec(base * LONG_PROMPT_FACTOR, p.output_tokens)

    await _baseline(run, rate, short)
    async with run.phase("fault", fault=True):
        await run.traffic.open_loop(rate, p.fault_s, long, "fault")
    await _recovery(run, rate)
    await run.check_idle(timeout_s=120)
    _common_checks(run)


# --- 3. noisy neighbour -------------------------------------------------------------------

HOGS_PER_CPU = 6
NEIGHBOUR_CLIENTS = 4


async def noisy_neighbour(run: Run) -> None:
    p = run.profile
    async with run.phase("baseline"):
        await run.traffic.closed_loop(NEIGHBOUR_CLIENTS, p.baseline_s, run.std, "baseline")
    hogs = HOGS_PER_CPU * (os.cpu_count() or 1)
    run.extra["hog_processes"] = hogs
    async with run.phase("fault", fault=True):
        with CpuHog(hogs, max_s=p.fault_s + 30):
            await run.traffic.closed_loop(NEIGHBOUR_CLIENTS, p.fault_s, run.std, "fault")
    async with run.phase("recovery"):
        await run.traffic.closed_loop(NEIGHBOUR_CLIENTS, p.recovery_s, run.std, "recovery")
    await run.check_idle()
    _common_checks(run)
    base, fault = (
        latency_ms(run.outcomes("baseline"), "tpot", 50),
        latency_ms(run.outcomes("fault"), "tpot", 50),
    )
    run.check(
        "tpot_slowed", bool(base and fault and fault > 1.5 * base), baseline=base, fault=fault
    )


# --- 4. KV exhaustion ---------------------------------------------------------------------

KV_TOKENS = 1024
LONG_OUTPUT = 400


async def kv_exhaustion(run: Run) -> None:
    p = run.profile
    async with run.phase("baseline"):
        await run.traffic.closed_loop(2, p.baseline_s, run.std, "baseline")
    before = await run.metric("moeserve_preemptions_total")

    def long() -> object:
        return run.traffic.spec(p.prompt_tokens, LONG_OUTPUT)

    async with run.phase("fault", fault=True):
        await run.traffic.closed_loop(p.max_num_seqs, p.fault_s, long, "fault")
    async with run.phase("recovery"):
        await run.traffic.closed_loop(2, p.recovery_s, run.std, "recovery")
    preempted = await run.metric("moeserve_preemptions_total") - before
    run.extra["preemptions"] = int(preempted)
    run.check("preempted", preempted > 0, preemptions=preempted)
    await run.check_idle()
    _common_checks(run)


# --- 5. disconnect storm ------------------------------------------------------------------

STORM_CLIENTS = 2
STORM_PAUSE_S = 0.5  # between one client's hang-ups: the storm adds ~30% of capacity in prefills
STORM_FINAL = 8


async def disconnect_storm(run: Run) -> None:
    cap = await run.capacity()
    p = run.profile
    await _baseline(run, BASE_LOAD * cap)
    aborts_before = await run.metric("moeserve_requests_total", finish_reason="abort")
    rng = random.Random(5)

    def long() -> object:
        return run.traffic.spec(p.prompt_tokens, 256)

    async def storm_client(end: float) -> None:
        while time.monotonic() < end:
            await run.traffic.hang_up(long(), rng.randint(0, 8), "fault")
            await asyncio.sleep(STORM_PAUSE_S)

    async with run.phase("fault", fault=True):
        end = time.monotonic() + p.fault_s
        await asyncio.gather(
            run.traffic.open_loop(BASE_LOAD * cap, p.fault_s, run.std, "fault"),
            *(storm_client(end) for _ in range(STORM_CLIENTS)),
        )
        await run.traffic.drain()
        # the last wave: every stream running, then all hang up at once
        await asyncio.gather(*(run.traffic.hang_up(long(), 3, "fault") for _ in range(STORM_FINAL)))
        idle = await run.idle_after(5.0)
    run.check("kv_idle_within_1s", idle is not None and idle <= 1.0, seconds=idle)
    await run.traffic.drain()
    await asyncio.sleep(0.5)
    aborts = await run.metric("moeserve_requests_total", finish_reason="abort") - aborts_before
    hangups = len(run.outcomes("fault", kind="storm"))
    run.extra["hang_ups"] = hangups
    run.extra["aborts_counted"] = int(aborts)
    # a client that hangs up before its first event may beat the request to the engine
    started = sum(1 for _ in run.outcomes("fault", kind="storm"))
    run.check("aborts_counted", 0.5 * started <= aborts <= started, aborts=aborts, hang_ups=hangups)
    await _recovery(run, BASE_LOAD * cap)
    await run.check_idle()
    _common_checks(run)


# --- 6. trace collector down, then slow ---------------------------------------------------

SLOW_EXPORT_S = 5.0


async def collector_down_then_slow(run: Run) -> None:
    cap = await run.capacity()
    rate = BASE_LOAD * cap
    p = run.profile
    await _baseline(run, rate)
    dropped_before = await run.metric("moeserve_trace_spans_dropped_total")
    async with run.phase("fault", fault=True):
        run.otlp.down()
        await run.traffic.open_loop(rate, p.fault_s / 2, run.std, "fault")
    async with run.phase("slow"):
        run.otlp.slow(SLOW_EXPORT_S)
        await run.traffic.open_loop(rate, p.fault_s / 2, run.std, "slow")
    run.otlp.up()
    await _recovery(run, rate)
    await run.check_idle()
    dropped = await run.metric("moeserve_trace_spans_dropped_total") - dropped_before
    run.extra["spans_dropped"] = int(dropped)
    run.extra["spans_received"] = run.otlp.spans
    run.check("spans_dropped_counted", dropped > 0, dropped=dropped)
    _common_checks(run)
    base = latency_ms(run.outcomes("baseline"), "ttft", 50)
    for phase in ("fault", "slow"):
        got = latency_ms(run.outcomes(phase), "ttft", 50)
        ok = base is not None and got is not None and got <= 1.5 * base + 20
        run.check(f"no_added_latency_{phase}", ok, baseline_ttft_p50_ms=base, ttft_p50_ms=got)


# --- 7. engine core killed ----------------------------------------------------------------


async def engine_core_killed(run: Run) -> None:
    cap = await run.capacity()
    rate = BASE_LOAD * cap / 2  # requests twice the standard length: the same load
    p = run.profile

    def streams() -> object:  # long enough that some are in flight at the kill
        return run.traffic.spec(p.prompt_tokens, 2 * p.output_tokens)

    await _baseline(run, rate, streams)
    first = run.server.current
    seen: dict[str, int] = {}

    async def probe(until: float) -> None:
        while time.monotonic() < until and not run.server.restarts:
            for path in ("/health", "/ready"):
                try:
                    r = await run.http.get(first.url + path, timeout=2)
                except httpx.HTTPError:  # gone between probes: that is the point
                    continue
                if r.status_code == 503:
                    seen[path] = seen.get(path, 0) + 1
            await asyncio.sleep(0.1)

    async with run.phase("fault", fault=True):
        load = asyncio.ensure_future(run.traffic.open_loop(rate, p.fault_s, streams, "fault"))
        await asyncio.sleep(min(3.0, p.fault_s / 4))
        in_flight = run.traffic.in_flight
        killed_at = time.monotonic()
        kill_engine_core(first)
        await probe(killed_at + p.fault_s)
        while not run.server.restarts and time.monotonic() - killed_at < p.fault_s + 60:
            await asyncio.sleep(0.2)
        await load
    await _recovery(run, rate)
    await run.check_idle()
    restarts = run.server.restarts
    run.extra["in_flight_at_kill"] = in_flight
    run.extra["probes_503"] = seen
    run.check("health_503", seen.get("/health", 0) > 0, seen=seen.get("/health", 0))
    run.check("ready_503", seen.get("/ready", 0) > 0, seen=seen.get("/ready", 0))
    run.check(
        "restarted",
        bool(restarts)
        and restarts[0]["ready_after_s"] is not None
        and restarts[0]["exit_code"] == 3,
        restarts=restarts,
    )
    clean = [
        o
        for o in run.outcomes("fault")
        if o.error_code == "engine_dead" and o.status == "stream_error"
    ]
    run.check(
        "in_flight_streams_ended_cleanly", bool(clean) or in_flight == 0, error_events=len(clean)
    )
    after = [o for o in run.outcomes("recovery") if o.outcome == "completed"]
    run.check("serving_after_restart", bool(after), completed=len(after))
    _common_checks(run, allow_failed=True)
    # 503s while it was dead are the point; anything else is not
    fives = [o for o in run.outcomes(kind=None) if o.http_5xx and o.status != "503"]
    run.check("no_5xx", not fives, other_5xx=len(fives))


# --- 8. hostile input -----------------------------------------------------------------------

HOSTILE_RATE = 40.0  # malformed requests per second, from 4 concurrent clients


async def hostile_input(run: Run) -> None:
    cap = await run.capacity()
    rate = BASE_LOAD * cap
    p = run.profile
    await _baseline(run, rate)
    async with run.phase("fault", fault=True):
        good = asyncio.ensure_future(_good_until(run, rate))
        result = await _hostile_process(run, p.hostile_count)
        good.cancel()
        await asyncio.gather(good, return_exceptions=True)
    await _recovery(run, rate)
    await run.check_idle()
    run.extra["malformed_sent"] = result["sent"]
    run.extra["malformed_5xx"] = result["5xx"]
    run.extra["malformed_by_category"] = result["by_category"]
    run.extra["malformed_transport_errors"] = result["errors"]
    run.extra["malformed_rps"] = round(result["sent"] / max(result["seconds"], 1e-3), 1)
    run.check("server_alive", run.server.current.poll() is None and not run.server.restarts)
    _common_checks(run)
    base = latency_ms(run.outcomes("baseline"), "ttft", 99)
    got = latency_ms(run.outcomes("fault"), "ttft", 99)
    run.check(
        "good_ttft_p99_within_2x", bool(base and got and got <= 2 * base), baseline=base, fault=got
    )


async def _hostile_process(run: Run, count: int) -> dict:
    """bench/scenarios/hostile.py in a process of its own (at HOSTILE_RATE), at the lowest
    CPU priority: on the test machine the sender shares the server's two cores, and an
    attacker's own CPU time is not the server's to pay (it still pays for every request)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.scenarios.hostile", run.url, run.server.current.model,
        API_KEY, str(count), "--rate", str(HOSTILE_RATE),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, preexec_fn=lambda: os.nice(19),
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=count / HOSTILE_RATE * 3 + 120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"the hostile sender exited with {proc.returncode}"
    return json.loads(out.decode().strip().splitlines()[-1])


async def _good_until(run: Run, rate: float) -> None:
    while True:
        await run.traffic.open_loop(rate, 5.0, run.std, "fault")


# --- 9. soak ----------------------------------------------------------------------------------

SOAK_LOAD = 0.8


async def soak(run: Run) -> None:
    cap = await run.capacity()
    p = run.profile
    async with run.phase("soak", fault=True):
        await run.traffic.open_loop(SOAK_LOAD * cap, p.soak_s, run.std, "soak")
    await run.check_idle()
    errors = [o for o in run.outcomes() if o.outcome != "completed"]
    run.check(
        "no_errors", not errors, errors=len(errors), statuses=sorted({o.status for o in errors})
    )
    _common_checks(run)
    run.extra["soak_s"] = p.soak_s
    # resident memory after the warm-up against the end (a minute's mean each)
    samples = run.rss.samples if run.rss else []
    t_end = samples[-1][0] if samples else 0.0
    warm = [b for t, b in samples if p.soak_warmup_s <= t - samples[0][0] < p.soak_warmup_s + 60]
    last = [b for t, b in samples if t >= t_end - 60]
    if warm and last:
        growth = (sum(last) / len(last)) / (sum(warm) / len(warm)) - 1
        run.extra["rss_growth_after_warmup"] = round(growth, 4)
        run.check("rss_growth_under_5pct", growth < 0.05, growth=round(growth, 4))
    else:
        run.check("rss_growth_under_5pct", False, reason="too few RSS samples")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "arrival_burst",
            "queue",
            f"{BURST:g}x the measured capacity for the fault phase (Poisson arrivals)",
            arrival_burst,
            server_args=("--max-waiting", "16"),
        ),
        Scenario(
            "long_prompt_surge",
            "prefill",
            f"prompts {LONG_PROMPT_FACTOR}x longer at the baseline's arrival rate (the baseline's "
            f"length sized so the surge asks for {SURGE_OVERLOAD:g}x the server's prefill rate)",
            long_prompt_surge,
        ),
        Scenario(
            "noisy_neighbour",
            "step_time",
            f"{HOGS_PER_CPU} CPU-bound processes per core beside the server",
            noisy_neighbour,
        ),
        Scenario(
            "kv_exhaustion",
            "kv_cache",
            f"{LONG_OUTPUT}-token generations at a full batch against a {KV_TOKENS}-token KV cache",
            kv_exhaustion,
            server_args=("--kv-cache-tokens", str(KV_TOKENS)),
        ),
        Scenario(
            "disconnect_storm",
            None,
            f"{STORM_CLIENTS} clients hanging up mid-stream beside ordinary traffic",
            disconnect_storm,
        ),
        Scenario(
            "collector_down_then_slow",
            "trace_export",
            f"the OTLP collector down for half the fault phase, then {SLOW_EXPORT_S:g} s per export",
            collector_down_then_slow,
            exporter=True,
        ),
        Scenario(
            "engine_core_killed",
            "engine",
            "SIGKILL to the engine core mid-load, the server under a restart-on-exit supervisor",
            engine_core_killed,
            supervised=True,
        ),
        Scenario(
            "hostile_input",
            None,
            "malformed requests (wrong types, malformed JSON, invalid UTF-8, deep nesting, huge "
            "bodies, bad auth, bad HTTP) beside good traffic",
            hostile_input,
            api_key=True,
        ),
        Scenario(
            "soak",
            None,
            f"{SOAK_LOAD:.0%} of capacity for 30 minutes",
            soak,
            server_args=("--max-waiting", "256"),
            in_full=False,
        ),
    )
}

# the scenarios whose rates are fractions of the measured capacity
CAPACITY_USERS = {
    "arrival_burst",
    "long_prompt_surge",
    "disconnect_storm",
    "collector_down_then_slow",
    "engine_core_killed",
    "hostile_input",
    "soak",
}
