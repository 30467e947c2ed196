"""Traffic for the scenarios, sent with our load generator's client (loadtest/bench_serving.py:
streamed completions with a fresh traceparent each, TTFT/TPOT on the client's clock) and
classified by what the client got back:

- completed: 200 and a stream that ended with `data: [DONE]` (after content, as a rule)
- rejected_429: refused with 429 (`retry_after` keeps its Retry-After header)
- failed: a definite answer other than success: an HTTP error status, a stream that ended
  with an error event, a connection refused (the server is not there)
- lost: anything else: a timeout (hung), a connection dropped mid-stream without an error
  event, a stream that stopped without `data: [DONE]`, a chunk that is not JSON
- disconnected: the client hung up on purpose (disconnect storm)
"""

from __future__ import annotations

import asyncio
import importlib
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.harness import REPO

OUTCOMES = ("completed", "rejected_429", "failed", "lost", "disconnected")


def bench_serving() -> Any:
    """loadtest/bench_serving.py as a module (a script beside its prompt_words module)."""
    path = str(REPO / "loadtest")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("bench_serving")


@dataclass(slots=True)
class Outcome:
    """One request and what became of it (times in seconds; `start` since the run began)."""

    phase: str
    kind: str  # good | storm
    start: float
    outcome: str
    status: str  # HTTP status, or bench_serving's transport / stream status
    error_code: str = ""
    retry_after: str = ""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: str = ""

    @property
    def http_5xx(self) -> bool:
        return self.status.isdigit() and int(self.status) >= 500


def classify(result: Any) -> str:
    """bench_serving's RequestResult -> one of OUTCOMES (disconnected is set by the caller)."""
    if result.ok or result.status == "no_content":
        # no_content: a whole stream up to [DONE] whose tokens decode to no text (the demo
        # model's random weights can pick special or partial-UTF-8 tokens only)
        return "completed"
    status = result.status
    if status == "429":
        return "rejected_429"
    if status.isdigit() or status in ("stream_error", "ConnectError"):
        return "failed"
    return "lost"


class Traffic:
    """Requests against one server (`url`), every outcome kept in `outcomes`."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        t0: float | None = None,
        seed: int = 0,
    ) -> None:
        self.bs = bench_serving()
        # a connection per request: arrivals are independent users. A shared keep-alive pool
        # lost one request in about five CI runs at the end of the burst (ReadError before any
        # response byte, the server never saw it: a pooled connection closing as it was
        # reused, on a client loop lagging behind the burst); ten runs with fresh connections
        # lost none
        argv = ["--base-url", url, "--model", model, "--ignore-eos", "--timeout", str(timeout_s)]
        argv.append("--fresh-connections")
        if api_key:
            argv += ["--api-key", api_key]
        self.args = self.bs.build_parser().parse_args(argv)
        self.client = self.bs.Client(self.args)
        self.url = url
        self.timeout_s = timeout_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.rng = random.Random(seed)
        self.pool: list[int] = []
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._n = 0

    async def prepare(self) -> None:
        """The token-id pool prompts are drawn from (POST /tokenize of random words)."""
        words = random.Random(1)
        sample = " ".join(words.choice(self.bs.WORDS) for _ in range(400))
        ids = await self.client.tokenize(sample)
        assert ids, f"POST /tokenize on {self.url} gave no token ids"
        self.pool = sorted(set(ids))

    async def aclose(self) -> None:
        await self.client.aclose()

    def spec(self, prompt_tokens: int, output_tokens: int) -> Any:
        """A completions request with `prompt_tokens` random token ids and `output_tokens`
        to generate (ignore_eos)."""
        ids = [self.rng.choice(self.pool) for _ in range(prompt_tokens)]
        return self.bs.RequestSpec(ids, output_tokens, prompt_tokens)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, spec: Any, phase: str, kind: str = "good") -> Outcome:
        self._n += 1
        trace_id, _ = self.bs.new_traceparent()
        result = self.bs.RequestResult(
            index=self._n, trace_id=trace_id, request_id=f"scn-{phase}-{self._n}"
        )
        start = self.now()
        self.in_flight += 1
        try:
            await self.client.send(spec, result, time.perf_counter())
        finally:
            self.in_flight -= 1
        outcome = Outcome(
            phase=phase,
            kind=kind,
            start=start,
            outcome=classify(result),
            status=result.status,
            error_code=result.error_code,
            retry_after=result.retry_after,
            ttft=result.ttft,
            tpot=result.tpot,
            e2e=result.e2el,
            error=result.error,
        )
        self.outcomes.append(outcome)
        return outcome

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def open_loop(
        self, rate: float, duration_s: float, make_spec: Callable[[], Any], phase: str
    ) -> None:
        """Poisson arrivals at `rate`/s for `duration_s` of wall time (each request runs on
        its own: this returns at the end of the period; `drain` waits for them). When the
        client falls behind its schedule it sends the arrivals due at once, never past the
        period's end."""
        end = time.monotonic() + duration_s
        next_at = time.monotonic()
        while True:
            next_at += self.rng.expovariate(rate)
            if next_at >= end:
                break
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif time.monotonic() >= end:
                break
            else:
                await asyncio.sleep(0)
            self._spawn(self.one(make_spec(), phase))
        await asyncio.sleep(max(0.0, end - time.monotonic()))

    async def closed_loop(
        self, concurrency: int, duration_s: float, make_spec: Callable[[], Any], phase: str
    ) -> None:
        """`concurrency` clients, each sending its next request when the last one ended,
        for `duration_s` (the last ones finish before this returns)."""
        end = time.monotonic() + duration_s

        async def client() -> None:
            while time.monotonic() < end:
                out = await self.one(make_spec(), phase)
                if out.outcome != "completed":
                    await asyncio.sleep(0.2)  # a refused or failed client backs off a little

        await asyncio.gather(*(client() for _ in range(concurrency)))

    async def hang_up(self, spec: Any, after_chunks: int, phase: str) -> Outcome:
        """Starts a stream and disconnects after `after_chunks` events (0: as soon as the
        response headers arrive)."""
        body = self.client.body(spec)
        start = self.now()
        status = ""
        try:
            async with self.client.http.stream("POST", self.client.url, json=body) as resp:
                status = str(resp.status_code)
                n = 0
                async for line in resp.aiter_lines():
                    if n >= after_chunks:
                        break
                    if line.startswith("data:"):
                        n += 1
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        outcome = Outcome(phase, "storm", start, "disconnected", status)
        self.outcomes.append(outcome)
        return outcome

    async def drain(self, timeout_s: float | None = None) -> None:
        """Waits for every request still running (at most the client timeout + 10 s)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s or self.timeout_s + 10)


# --- summaries ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation), None without values."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_ms(outcomes: list[Outcome], field: str, q: float) -> float | None:
    """The q-th percentile of `field` (ttft | tpot) over completed requests, in ms."""
    v = percentile([getattr(o, field) for o in outcomes if o.outcome == "completed"], q)
    return None if v is None else round(v * 1000, 1)


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    """sent, completed, rejected_429, failed, lost, disconnected and 5xx."""
    out = {"sent": len(outcomes), **dict.fromkeys(OUTCOMES, 0), "5xx": 0}
    for o in outcomes:
        out[o.outcome] += 1
        out["5xx"] += o.http_5xx
    return out
