"""Runs one scenario: its server (under a supervisor where the scenario kills it), the
observability stack when the profile has one, the scenario's traffic and fault, and what it
all saw, as one row of bench/results/scenarios.json.

A scenario is an async function of a `Run`: it sends traffic (`run.traffic`), marks its
phases (`run.phase`), injects its fault, and states its invariants (`run.check`). The
`Run` watches the rest: the alerts Prometheus fires (polled every second), the webhook's
incidents, the server's resident memory, and whether its KV cache went back to idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness import HOST, ServerProcess, free_port
from bench.scenarios.faults import RssSampler
from bench.scenarios.load import Traffic, counts, latency_ms
from bench.scenarios.stack import Stack, binaries
from bench.scenarios.supervisor import Supervisor

API_KEY = "sk-scenarios"


@dataclass(frozen=True)
class Profile:
    """Sizes and durations of one kind of run (the full set, or CI's short phases)."""

    name: str
    model: str = "demo"  # a checkpoint folder, or "demo" (the demo model, preset below)
    preset: str = "small"
    baseline_s: float = 40.0  # traffic before the fault: the detector's reference stretch
    fault_s: float = 60.0
    recovery_s: float = 15.0
    calibrate_s: float = 20.0  # the capacity measurement
    prompt_tokens: int = 64
    output_tokens: int = 32
    max_num_seqs: int = 8
    hostile_count: int = 10_000
    stack: bool = True  # Prometheus, Alertmanager and the webhook
    settle_s: float = 8.0  # after the traffic: late alerts and their analysis
    soak_s: float = 1800.0
    soak_warmup_s: float = 300.0


FULL = Profile("full")
CI = Profile(
    "ci",
    preset="tiny",
    baseline_s=5.0,
    fault_s=10.0,
    recovery_s=3.0,
    calibrate_s=5.0,
    hostile_count=1500,
    stack=False,
    settle_s=0.0,
)


@dataclass
class Scenario:
    name: str
    cause: str | None  # the ground truth the webhook should name; None: should not alert
    summary: str
    drive: Callable[[Run], Awaitable[None]]
    server_args: tuple[str, ...] = ()
    supervised: bool = False
    api_key: bool = False
    exporter: bool = False  # the server exports spans to the run's OTLP sink
    in_full: bool = True  # part of `make scenarios` (the soak is not)


@dataclass
class Phase:
    name: str
    start: float
    end: float | None = None


@dataclass
class Run:
    """What a scenario function works with."""

    scenario: Scenario
    profile: Profile
    server: Supervisor
    traffic: Traffic
    stack: Stack | None
    http: httpx.AsyncClient
    capacity_of: Callable[[Run], Awaitable[float]]
    env: dict[str, str]
    otlp: Any = None  # the OtlpSink of an exporting scenario
    rss: RssSampler | None = None
    phases: list[Phase] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    alerts: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    fault_at: float | None = None  # wall clock

    @property
    def url(self) -> str:
        return self.server.current.url

    def std(self) -> Any:
        """The standard request of the run (prompt and output lengths of the profile)."""
        return self.traffic.spec(self.profile.prompt_tokens, self.profile.output_tokens)

    async def capacity(self) -> float:
        """Completed requests/s at full batch (measured once per run, on this server)."""
        return await self.capacity_of(self)

    @contextlib.asynccontextmanager
    async def phase(self, name: str, fault: bool = False) -> Iterator[None]:
        """Marks a phase; `fault=True` marks when the fault began (alert delays count
        from there)."""
        p = Phase(name, self.traffic.now())
        self.phases.append(p)
        if fault and self.fault_at is None:
            self.fault_at = time.time()
        try:
            yield
        finally:
            p.end = self.traffic.now()

    def check(self, name: str, ok: bool, **detail: Any) -> None:
        """An invariant of the scenario and what was measured."""
        self.checks[name] = {"ok": bool(ok), **detail}

    def outcomes(self, phase: str | None = None, kind: str | None = "good") -> list:
        return [
            o
            for o in self.traffic.outcomes
            if (phase is None or o.phase == phase) and (kind is None or o.kind == kind)
        ]

    async def ready(self) -> dict[str, Any] | None:
        try:
            r = await self.http.get(self.url + "/ready")
        except httpx.HTTPError:
            return None
        return (
            r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        )

    async def idle_after(self, timeout_s: float = 10.0) -> float | None:
        """Seconds until /ready shows no KV block used and nothing running, waiting or in
        flight; None when that took over `timeout_s`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            body = await self.ready()
            busy = ("kv_blocks_used", "num_running", "num_waiting", "in_flight")
            if body and not any(body[k] for k in busy):
                return round(time.monotonic() - start, 3)
            await asyncio.sleep(0.02)
        return None

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples on the server's /metrics matching `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        r = await self.http.get(self.url + "/metrics")
        total = 0.0
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    async def check_idle(self, timeout_s: float = 10.0) -> None:
        """The standard end-of-scenario invariant: the KV cache back to idle."""
        await self.traffic.drain()
        idle = await self.idle_after(timeout_s)
        self.check("kv_idle_at_end", idle is not None, seconds=idle)

    async def _watch_alerts(self) -> None:
        if self.stack is None:
            return
        while True:
            try:
                for labels in await self.stack.firing(self.http):
                    key = (labels.get("alertname", ""), labels.get("severity", ""))
                    if key not in self.alerts:
                        self.alerts[key] = {
                            "alertname": key[0],
                            "severity": key[1],
                            "at": time.time(),
                        }
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(1.0)


def _server_env(scenario: Scenario, otlp_endpoint: str | None) -> dict[str, str]:
    env = {
        # one intra-op thread: with two OpenMP threads on two cores, anything else running
        # (the load generator, Prometheus, another job) stalls every op at its barriers
        "OMP_NUM_THREADS": os.environ.get("SCENARIO_OMP_THREADS", "1"),
        "OTEL_TRACES_EXPORTER": "none",
    }
    if scenario.exporter and otlp_endpoint:
        env.update(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_BSP_SCHEDULE_DELAY="500",
        )
    return env


def server_factory(
    scenario: Scenario, profile: Profile, port: int, env: dict[str, str], workdir: Path
) -> Callable[[], ServerProcess]:
    args = [
        "--served-model-name", "demo", "--max-num-seqs", str(profile.max_num_seqs),
        "--drain-timeout", "5", *scenario.server_args,
    ]  # fmt: skip
    if profile.model == "demo":
        args += ["--demo-preset", profile.preset]
    n = 0

    def make() -> ServerProcess:
        nonlocal n
        n += 1
        return ServerProcess(
            profile.model,
            *args,
            port=port,
            api_key=API_KEY if scenario.api_key else None,
            env=env,
            log_path=workdir / f"moeserve-{n}.log",
            start_timeout=300,
            stop_timeout=20,
        )

    return make


async def calibrate(profile: Profile, workdir: Path) -> float:
    """The capacity measured on a server of its own (standard settings, no stack), so that
    the overload it takes leaves no trace in a scenario's Prometheus."""
    probe = Scenario("calibrate", None, "capacity measurement", lambda run: asyncio.sleep(0))
    workdir.mkdir(parents=True, exist_ok=True)
    make = server_factory(probe, profile, free_port(), _server_env(probe, None), workdir)
    with make() as server:
        traffic = Traffic(server.url, server.model, timeout_s=120)
        await traffic.prepare()
        try:
            spec = lambda: traffic.spec(profile.prompt_tokens, profile.output_tokens)
            await traffic.closed_loop(profile.max_num_seqs, profile.calibrate_s, spec, "calibrate")
        finally:
            await traffic.aclose()
    return _completed_per_s(traffic.outcomes)


def _completed_per_s(outcomes: list) -> float:
    done = [o for o in outcomes if o.outcome == "completed"]
    assert done, "no request completed while measuring the capacity"
    span = max(o.start + (o.e2e or 0) for o in done) - min(o.start for o in done)
    return len(done) / max(span, 1e-3)


async def measure_capacity(run: Run, cache: dict[str, float]) -> float:
    """Completed requests/s of the standard request at concurrency max_num_seqs."""
    if "capacity" not in cache:
        p = run.profile
        async with run.phase("calibrate"):
            await run.traffic.closed_loop(p.max_num_seqs, p.calibrate_s, run.std, "calibrate")
        cache["capacity"] = _completed_per_s(run.outcomes("calibrate"))
    run.extra["capacity_rps"] = round(cache["capacity"], 2)
    return cache["capacity"]


async def run_scenario(
    scenario: Scenario, profile: Profile, workdir: Path, cache: dict[str, float]
) -> dict[str, Any]:
    """Runs `scenario` and returns its row (everything it started is stopped again)."""
    from bench.scenarios.faults import OtlpSink
    from bench.scenarios.score import build_row

    workdir.mkdir(parents=True, exist_ok=True)
    bins = binaries() if profile.stack else None
    if profile.stack and bins is None:
        raise RuntimeError("prometheus / prometheus-alertmanager not installed")
    port = free_port()
    with contextlib.ExitStack() as stack:
        otlp = stack.enter_context(OtlpSink()) if scenario.exporter else None
        env = _server_env(scenario, otlp.endpoint if otlp else None)
        make = server_factory(scenario, profile, port, env, workdir)
        supervisor = Supervisor(make, max_restarts=3 if scenario.supervised else 0)
        stack.enter_context(supervisor)
        obs = None  # started once the server is ready: its first scrape finds it up
        if bins is not None:
            obs = stack.enter_context(Stack(workdir, f"{HOST}:{port}", bins))
        sampler = stack.enter_context(
            RssSampler(lambda: supervisor.current.pid if supervisor.current else None)
        )
        t_start = time.time()
        raw = await _drive(scenario, profile, supervisor, obs, env, otlp, cache, sampler)
    row = build_row(raw)
    row["duration_s"] = round(time.time() - t_start, 1)
    return row


async def _drive(scenario, profile, supervisor, obs, env, otlp, cache, sampler) -> dict[str, Any]:
    server = supervisor.current
    traffic = Traffic(
        server.url, server.model, api_key=API_KEY if scenario.api_key else None, timeout_s=120
    )
    async with httpx.AsyncClient(timeout=10) as http:
        run = Run(
            scenario=scenario,
            profile=profile,
            server=supervisor,
            traffic=traffic,
            stack=obs,
            http=http,
            capacity_of=lambda r: measure_capacity(r, cache),
            env=env,
            otlp=otlp,
            rss=sampler,
        )
        await traffic.prepare()
        watcher = asyncio.ensure_future(run._watch_alerts())
        try:
            await scenario.drive(run)
            await traffic.drain()
            if obs is not None:
                await asyncio.sleep(profile.settle_s)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not await obs.webhook_idle(http):
                    await asyncio.sleep(0.5)
                incidents = await obs.incidents(http)
            else:
                incidents = []
        finally:
            watcher.cancel()
            await traffic.aclose()
    return {
        "scenario": scenario,
        "profile": profile.name,
        "run": run,
        "counts": counts(run.outcomes(kind=None)),
        "latency": {
            "ttft_p50_ms": latency_ms(run.outcomes(), "ttft", 50),
            "ttft_p99_ms": latency_ms(run.outcomes(), "ttft", 99),
            "tpot_p50_ms": latency_ms(run.outcomes(), "tpot", 50),
            "tpot_p99_ms": latency_ms(run.outcomes(), "tpot", 99),
        },
        "peak_rss_mb": round(sampler.peak / 2**20, 1),
        "rss": sampler.samples,
        "incidents": incidents,
        "restarts": supervisor.restarts,
    }


def workdir_for(root: Path | None, name: str) -> Path:
    base = root or Path(tempfile.mkdtemp(prefix="scenarios-"))
    return base / name
