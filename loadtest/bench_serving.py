#!/usr/bin/env python3
"""Serving benchmark for any OpenAI-compatible endpoint (after `vllm bench serve`).

    python loadtest/bench_serving.py --base-url http://127.0.0.1:8000 \
        --endpoint /v1/completions --num-prompts 64 --input-len 128 --output-len 128 \
        --ignore-eos --max-concurrency 4 --slo ttft:500,tpot:50 --result-file out.json

Workload
  --dataset random      random prompts of --input-len tokens (uniform in
                        [L*(1-r), L*(1+r)] with --range-ratio r); --output-len likewise.
  --dataset file        prompts from --dataset-path: .jsonl records {"prompt": str | [ids],
                        "output_len": int (optional)} or {"messages": [...]}, or a text file
                        with one prompt per line.
  --prompt-format       ids (completions only): the prompt is sent as a list of token ids
                        (the OpenAI completions API accepts them), so prompt lengths are
                        exact; ids are drawn from what the server's POST /tokenize returns for
                        random words (vLLM and moeserve have it), else from --token-id-range.
                        text: random words, sized with POST /tokenize when the server has it
                        (within a token or two), else at ~1.3 tokens a word.
                        auto (default): ids for /v1/completions, text for chat.
Arrivals
  --request-rate R      requests/s with gamma inter-arrival times (shape --burstiness,
                        scale 1/(R*burstiness)); burstiness 1 is Poisson, < 1 burstier.
                        inf (default) sends everything at once.
  --max-concurrency N   at most N requests in flight (a client-side semaphore). With the
                        default rate inf this is a fixed-concurrency run.
  --num-warmups N       requests sent (one at a time) before the measured run; excluded from
                        the numbers, reported under "warmup" in the JSON.

Measurements (per request, on the client's clock)
  TTFT   request sent -> first chunk carrying content (role-only / empty chunks skipped)
  ITL    gaps between successive content chunks
  TPOT   (e2e latency - TTFT) / (output tokens - 1), for requests with >= 2 output tokens
  E2EL   request sent -> end of the stream
  Output tokens come from the final usage chunk (stream_options.include_usage), falling
  back to the number of content chunks when the server sends no usage.
  Goodput (--slo ttft:MS,tpot:MS,e2el:MS): completed requests meeting every SLO, per second.
  Peak output tokens/s: the most output tokens received in any whole second of the run.

Tracing: each request carries a fresh W3C `traceparent` and an `x-request-id`; both ids (and
the server's own `traceparent`/`x-request-id` response headers) are kept per request in the
JSON (--save-detailed) and the slowest requests are printed with their trace ids, to be looked
up in the trace backend.

`--server-metrics` also scrapes the server's Prometheus /metrics before and after the
measured run and reports the deltas of its *prompt_tokens_total / *generation_tokens_total
counters next to the client's token counts.

Exit status: 0, or 1 when a request failed (unless --allow-failures) or none completed.
Needs only httpx; it never imports moeserve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prompt_words import FALLBACK_TOKENS_PER_WORD, WORDS

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_slo(text: str | None) -> dict[str, float]:
    """ "ttft:500,tpot:50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in (text or "").replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"bad SLO {part!r}: use ttft:MS,tpot:MS,e2el:MS")
        try:
            slo[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO value in {part!r}") from None
        if slo[key] <= 0:
            raise argparse.ArgumentTypeError(f"SLO {key} must be > 0 ms")
    return slo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_serving",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[6:]),
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url", default=os.environ.get("MOESERVE_BASE_URL", "http://127.0.0.1:8000")
    )
    t.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions or /v1/chat/completions (anything with 'chat' in it "
        "is sent as a chat request)",
    )
    t.add_argument(
        "--model",
        default=os.environ.get("MOESERVE_SERVED_MODEL_NAME"),
        help="default: the first model from GET /v1/models",
    )
    t.add_argument(
        "--api-key",
        default=os.environ.get("MOESERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' [env MOESERVE_API_KEY, OPENAI_API_KEY]",
    )
    t.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra request header (repeatable)",
    )
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    t.add_argument(
        "--fresh-connections",
        action="store_true",
        help="a connection per request, as independent users open them, instead of one "
        "keep-alive pool",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["random", "file"], default="random")
    w.add_argument("--dataset-path", help="prompts for --dataset file (.jsonl or text)")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    w.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)] (0: fixed lengths)",
    )
    w.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto")
    w.add_argument(
        "--token-id-range",
        default="100-1000",
        help="A-B: token ids for --prompt-format ids when the server has no /tokenize",
    )
    w.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM/moeserve extension) so every request generates "
        "exactly its output length",
    )
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request body",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shuffle", action="store_true", help="shuffle file prompts")
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (gamma arrivals); inf: all at once (default)",
    )
    a.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular",
    )
    a.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (fixed concurrency with rate inf)",
    )
    a.add_argument("--num-warmups", type=int, default=1)
    r = p.add_argument_group("report")
    r.add_argument(
        "--slo",
        type=parse_slo,
        default={},
        metavar="ttft:MS,tpot:MS,e2el:MS",
        help="goodput SLOs in milliseconds (a request is good when it meets all)",
    )
    r.add_argument("--percentiles", default="50,90,99")
    r.add_argument(
        "--result-file",
        help="JSON result path (default: "
        "loadtest/results/bench-<model>-c<conc>-r<rate>-<time>.json)",
    )
    r.add_argument("--no-save", action="store_true", help="do not write the JSON result file")
    r.add_argument(
        "--save-detailed",
        action="store_true",
        help="per-request records (trace ids, TTFT, ITLs, status) in the JSON",
    )
    r.add_argument("--label", default="", help="free text stored in the JSON")
    r.add_argument("--request-id-prefix", default=None, help="x-request-id prefix")
    r.add_argument("--slowest", type=int, default=5, help="slowest requests printed with trace ids")
    r.add_argument(
        "--server-metrics",
        nargs="?",
        const="",
        default=None,
        metavar="URL",
        help="scrape Prometheus token counters before/after (default URL: <base-url>/metrics)",
    )
    r.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    r.add_argument("--allow-failures", action="store_true", help="exit 0 even if requests failed")
    return p


# ---------------------------------------------------------------------------------------------
# Requests and results


@dataclass
class RequestSpec:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    output_len: int
    prompt_len: int | None = None  # tokens, when known before sending


@dataclass
class RequestResult:
    index: int
    trace_id: str
    request_id: str
    prompt_len: int | None = None  # expected prompt tokens (client side)
    max_tokens: int = 0
    ok: bool = False
    status: str = ""
    error: str = ""
    start: float = 0.0  # seconds since the benchmark start
    ttft: float | None = None
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # since the benchmark start
    chunks: int = 0
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    server_request_id: str = ""
    server_trace_id: str = ""
    retry_after: str = ""  # the Retry-After header of a refusal (429, 503)
    error_code: str = ""  # the OpenAI error envelope's code (or type), response or stream event

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def new_traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def trace_id_of(traceparent: str | None) -> str:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) >= 4 and len(parts[1]) == 32 else ""


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.base_url.rstrip("/")
        self.chat = "chat" in args.endpoint
        self.url = self.base + "/" + args.endpoint.lstrip("/")
        headers = {}
        if args.api_key:
            headers["authorization"] = f"Bearer {args.api_key}"
        for item in args.header:
            name, _, value = item.partition("=")
            headers[name.strip()] = value.strip()
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(args.timeout, connect=30.0),
            # idle connections dropped after 2 s, before the server's keep-alive timeout
            # (uvicorn: 5 s, httpx's own default too): a request sent on a connection the
            # server is closing at that moment fails with ReadError before it reaches it
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=0 if args.fresh_connections else None,
                keepalive_expiry=2.0,
            ),
        )
        self.model: str = args.model or ""

    async def aclose(self) -> None:
        await self.http.aclose()

    async def resolve_model(self) -> str:
        if not self.model:
            try:
                r = await self.http.get(self.base + "/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise SystemExit(
                    f"cannot list models at {self.base}/v1/models (pass --model?): {exc}"
                ) from None
        return self.model

    async def tokenize(self, text: str) -> list[int] | None:
        """Token ids of `text` from POST /tokenize (None when the server has no such route)."""
        try:
            r = await self.http.post(
                self.base + "/tokenize",
                json={"model": self.model, "prompt": text, "add_special_tokens": False},
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        data = r.json()
        ids = data.get("tokens")
        return ids if isinstance(ids, list) else None

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        a = self.args
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": a.temperature,
        }
        if self.chat:
            messages = (
                spec.prompt
                if isinstance(spec.prompt, list)
                and spec.prompt
                and isinstance(spec.prompt[0], dict)
                else [{"role": "user", "content": spec.prompt}]
            )
            body.update(messages=messages, max_completion_tokens=spec.output_len)
        else:
            body.update(prompt=spec.prompt, max_tokens=spec.output_len)
        if a.ignore_eos:
            body["ignore_eos"] = True
        if a.extra_body:
            body.update(a.extra_body)
        return body

    async def send(self, spec: RequestSpec, result: RequestResult, t0: float) -> RequestResult:
        """Streams one request into `result` (times relative to the benchmark start `t0`)."""
        traceparent = f"00-{result.trace_id}-{secrets.token_hex(8)}-01"
        headers = {
            "traceparent": traceparent,
            "x-request-id": result.request_id,
            "accept": "text/event-stream",
        }
        content_key = "delta" if self.chat else "text"
        start = time.perf_counter()
        result.start = start - t0
        last = None
        try:
            async with self.http.stream(
                "POST", self.url, json=self.body(spec), headers=headers
            ) as resp:
                result.status = str(resp.status_code)
                result.server_request_id = resp.headers.get("x-request-id", "")
                result.server_trace_id = trace_id_of(resp.headers.get("traceparent"))
                if resp.status_code != 200:
                    result.retry_after = resp.headers.get("retry-after", "")
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = _error_message(text)
                    result.error_code = _error_code(text)
                    return result
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.status, result.error = "stream_error", _error_message(chunk)
                        result.error_code = _error_code(chunk)
                        return result
                    if usage := chunk.get("usage"):
                        result.prompt_tokens = usage.get("prompt_tokens")
                        result.completion_tokens = usage.get("completion_tokens")
                    for choice in chunk.get("choices") or ():
                        value = choice.get(content_key)
                        text = (value or {}).get("content") if self.chat else value
                        if not text:
                            continue
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.chunks += 1
                        result.chunk_times.append(now - t0)
                result.e2el = time.perf_counter() - start
                if not done:
                    result.status, result.error = "incomplete", "stream ended without data: [DONE]"
                elif result.ttft is None:
                    result.status, result.error = "no_content", "no content chunk in the stream"
                else:
                    result.ok = True
        except httpx.HTTPError as exc:
            result.status, result.error = type(exc).__name__, str(exc)[:300]
        except ValueError as exc:  # bad JSON in a chunk
            result.status, result.error = "bad_chunk", str(exc)[:300]
        finally:
            if not result.e2el:
                result.e2el = time.perf_counter() - start
        return result


def _error_code(payload: str | dict) -> str:
    """The `code` (else `type`) of an OpenAI error envelope, "" when there is none."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return ""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return ""
    return str(error.get("code") or error.get("type") or "")


def _error_message(payload: str | dict) -> str:
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload[:300]
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))[:300]
    return str(payload)[:300]


# ---------------------------------------------------------------------------------------------
# Datasets


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo = max(1, math.floor(length * (1 - ratio)))
    hi = max(lo, math.ceil(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def _text_of_length(
    client: Client, rng: random.Random, target: int, ratio: float | None, sem: asyncio.Semaphore
) -> tuple[str, int | None]:
    """Random words with `target` tokens per /tokenize (the closest word count found in a few
    secant steps); without /tokenize, ~1.3 tokens a word."""
    words: list[str] = []

    def text(n: int) -> str:
        while len(words) < n:
            words.append(rng.choice(WORDS))
        return " ".join(words[:n])

    if ratio is None:
        return text(max(1, round(target / FALLBACK_TOKENS_PER_WORD))), None
    n = max(1, round(target / ratio))
    counts: dict[int, int] = {}
    async with sem:
        for _ in range(12):
            ids = await client.tokenize(text(n))
            if ids is None:
                return text(n), None
            counts[n] = count = len(ids)
            if count == target:
                break
            nxt = round(n * target / count) if count else 2 * n
            if nxt == n:
                nxt = n + (1 if count < target else -1)
            nxt = max(nxt, 1)
            if nxt in counts:  # converged between two word counts
                break
            n = nxt
    n = min(counts, key=lambda k: (abs(counts[k] - target), counts[k] > target))
    return text(n), counts[n]


async def build_random(
    client: Client, args: argparse.Namespace, count: int, seed: int
) -> list[RequestSpec]:
    rng = random.Random(seed)
    in_lens = _lengths(rng, count, args.input_len, args.range_ratio)
    out_lens = _lengths(rng, count, args.output_len, args.range_ratio)
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "text" if client.chat else "ids"
    if fmt == "ids" and client.chat:
        raise SystemExit("--prompt-format ids needs a completions endpoint")
    sample_rng = random.Random(1)
    sample = " ".join(sample_rng.choice(WORDS) for _ in range(400))
    sample_ids = await client.tokenize(sample)
    if fmt == "ids":
        if sample_ids:
            pool = sorted(set(sample_ids))
        else:
            m = re.fullmatch(r"(\d+)-(\d+)", args.token_id_range)
            if not m:
                raise SystemExit("--token-id-range must be A-B")
            pool = list(range(int(m[1]), int(m[2])))
        return [
            RequestSpec([rng.choice(pool) for _ in range(n)], o, n)
            for n, o in zip(in_lens, out_lens)
        ]
    ratio = len(sample_ids) / 400 if sample_ids else None
    sem = asyncio.Semaphore(8)
    texts = await asyncio.gather(
        *[_text_of_length(client, random.Random(rng.random()), n, ratio, sem) for n in in_lens]
    )
    return [RequestSpec(text, o, n) for (text, n), o in zip(texts, out_lens)]


def build_file(args: argparse.Namespace, count: int, seed: int) -> list[RequestSpec]:
    path = Path(args.dataset_path or "")
    if not path.is_file():
        raise SystemExit(f"--dataset file needs --dataset-path (no such file: {path})")
    records: list[RequestSpec] = []
    jsonl = path.suffix in (".jsonl", ".json")
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if not jsonl:
            records.append(RequestSpec(line, args.output_len))
            continue
        rec = json.loads(line)
        prompt = rec.get("messages") or rec.get("prompt")
        if not prompt:
            raise SystemExit(f"{path}: every record needs 'prompt' or 'messages'")
        n = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], int) else None
        records.append(RequestSpec(prompt, int(rec.get("output_len") or args.output_len), n))
    if not records:
        raise SystemExit(f"{path}: no prompts")
    if args.shuffle:
        random.Random(seed).shuffle(records)
    return [records[i % len(records)] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# Running


class Progress:
    def __init__(self, total: int, mode: str) -> None:
        self.total = total
        self.done = self.failed = self.in_flight = self.tokens = 0
        self.tty = sys.stderr.isatty()
        self.enabled = mode == "on" or (mode == "auto" and total > 0)
        self.t0 = time.perf_counter()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"[bench] {self.done}/{self.total} done, {self.failed} failed, {self.in_flight} in "
            f"flight, {elapsed:6.1f} s, {rate:8.1f} output tok/s"
        )

    async def run(self) -> None:
        if not self.enabled:
            return
        interval = 0.5 if self.tty else 5.0
        while True:
            await asyncio.sleep(interval)
            sys.stderr.write(("\r" + self.line()) if self.tty else self.line() + "\n")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write(("\r" if self.tty else "") + self.line() + "\n")
            sys.stderr.flush()


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start): gamma inter-arrivals with mean 1/rate (all 0 for inf)."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run_benchmark(
    client: Client, specs: list[RequestSpec], args: argparse.Namespace, prefix: str
) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness, args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = Progress(len(specs), args.progress)
    t0 = time.perf_counter()
    progress.t0 = t0

    async def one(i: int, spec: RequestSpec) -> RequestResult:
        delay = offsets[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        trace_id, _ = new_traceparent()
        result = RequestResult(
            index=i,
            trace_id=trace_id,
            request_id=f"{prefix}{i}",
            prompt_len=spec.prompt_len,
            max_tokens=spec.output_len,
        )
        if sem is not None:
            await sem.acquire()
        progress.in_flight += 1
        try:
            await client.send(spec, result, t0)
        finally:
            progress.in_flight -= 1
            if sem is not None:
                sem.release()
        progress.done += 1
        progress.failed += not result.ok
        progress.tokens += result.output_tokens if result.ok else 0
        return result

    ticker = asyncio.ensure_future(progress.run())
    try:
        results = await asyncio.gather(*[one(i, s) for i, s in enumerate(specs)])
    finally:
        ticker.cancel()
    duration = time.perf_counter() - t0
    progress.finish()
    return list(results), duration


async def warm_up(client: Client, specs: list[RequestSpec], prefix: str) -> dict[str, Any]:
    results = []
    for i, spec in enumerate(specs):
        trace_id, _ = new_traceparent()
        r = RequestResult(
            index=i,
            trace_id=trace_id,
            request_id=f"{prefix}warmup-{i}",
            prompt_len=spec.prompt_len,
            max_tokens=spec.output_len,
        )
        results.append(await client.send(spec, r, time.perf_counter()))
    return {
        "requests": len(results),
        "completed": sum(r.ok for r in results),
        "prompt_tokens": sum(r.prompt_tokens or r.prompt_len or 0 for r in results),
        "output_tokens": sum(r.output_tokens for r in results),
        "trace_ids": [r.trace_id for r in results],
        "failures": {r.status: r.error for r in results if not r.ok},
    }


# ---------------------------------------------------------------------------------------------
# Server metrics


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)")


def parse_token_counters(text: str) -> dict[str, float]:
    """Sums of the *prompt_tokens_total and *generation_tokens_total samples (all labels)."""
    sums = {"prompt_tokens": 0.0, "generation_tokens": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m[1]
        for key in sums:
            if name.endswith(f"{key}_total") and not name.endswith(f"_{key}_total_created"):
                sums[key] += float(m[3])
    return sums


async def scrape(client: Client, url: str) -> dict[str, float] | None:
    try:
        r = await client.http.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return parse_token_counters(r.text) if r.status_code == 200 else None


async def scrape_settled(client: Client, url: str, tries: int = 10) -> dict[str, float] | None:
    """Scrapes until two scrapes 0.2 s apart agree (the last request may still be counted)."""
    last = await scrape(client, url)
    for _ in range(tries):
        await asyncio.sleep(0.2)
        now = await scrape(client, url)
        if now == last:
            break
        last = now
    return last


# ---------------------------------------------------------------------------------------------
# Metrics


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
    }
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(values[k] is not None and values[k] * 1000.0 <= v for k, v in slo.items())


def peak_output_rate(results: list[RequestResult]) -> float:
    """Most output tokens in one whole second (chunks weighted so each request's chunks sum
    to its usage-reported output tokens)."""
    buckets: dict[int, float] = {}
    for r in results:
        if not r.ok or not r.chunk_times:
            continue
        weight = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            buckets[int(t)] = buckets.get(int(t), 0.0) + weight
    return max(buckets.values(), default=0.0)


def peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted(
        [(r.start, 1) for r in results] + [(r.start + r.e2el, -1) for r in results],
        key=lambda e: (e[0], e[1]),
    )
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    args: argparse.Namespace,
    percentiles: list[float],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[r.status] = failures.get(r.status, 0) + 1
    have_usage = all(r.prompt_tokens is not None for r in ok)
    input_tokens = sum((r.prompt_tokens if have_usage else r.prompt_len) or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slo(r, args.slo)] if args.slo else []
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures_by_status": failures,
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_from": "usage" if have_usage else "client",
        "output_tokens_from": "usage"
        if all(r.completion_tokens is not None for r in ok)
        else "chunks",
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": len(good) / duration if args.slo and duration else None,
        "slo_attainment": len(good) / len(ok) if args.slo and ok else None,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "max_output_tokens_per_s": peak_output_rate(results),
        "max_concurrent_requests": peak_concurrency(results),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in METRICS:
        for stat, value in summarize(series[name], percentiles).items():
            m[f"{stat}_{name}_ms"] = value
    return m


def slowest(results: list[RequestResult], n: int) -> list[dict[str, Any]]:
    rows = sorted(results, key=lambda r: r.e2el, reverse=True)[: max(n, 0)]
    return [
        {
            "index": r.index,
            "trace_id": r.trace_id,
            "server_trace_id": r.server_trace_id,
            "request_id": r.request_id,
            "status": r.status,
            "e2el_ms": r.e2el * 1000,
            "ttft_ms": None if r.ttft is None else r.ttft * 1000,
            "tpot_ms": None if r.tpot is None else r.tpot * 1000,
            "output_tokens": r.output_tokens,
            "error": r.error,
        }
        for r in rows
    ]


def request_record(r: RequestResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("chunk_times")
    d.update(output_tokens=r.output_tokens, tpot=r.tpot)
    return d


def print_report(out: dict[str, Any], percentiles: list[float]) -> None:
    w = 60

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = (
            "n/a"
            if value is None
            else fmt.format(value)
            if isinstance(value, float)
            else str(value)
        )
        print(f"{label:<46}{text:>{w - 46}}")

    def head(title: str) -> None:
        print(f"{title:-^{w}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    row("Endpoint:", out["endpoint"])
    row("Model:", out["model"])
    row("Successful requests:", out["completed"])
    row("Failed requests:", out["failed"])
    for status, n in sorted(out["failures_by_status"].items()):
        row(f"  status {status}:", n)
    row("Maximum request concurrency:", out["max_concurrency"])
    row("Request rate configured (RPS):", out["request_rate"])
    row("Benchmark duration (s):", out["duration"])
    row("Total input tokens:", out["total_input_tokens"])
    row("Total generated tokens:", out["total_output_tokens"])
    row("Request throughput (req/s):", out["request_throughput"])
    if out["request_goodput"] is not None:
        row(f"Request goodput (req/s) [{out['slo_text']}]:", out["request_goodput"])
        row("SLO attainment:", out["slo_attainment"], "{:.1%}")
    row("Output token throughput (tok/s):", out["output_throughput"])
    row("Peak output token throughput (tok/s):", out["max_output_tokens_per_s"])
    row("Peak concurrent requests:", out["max_concurrent_requests"])
    row("Total token throughput (tok/s):", out["total_token_throughput"])
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in METRICS:
        head(titles[name])
        row(f"Mean {name.upper()} (ms):", out[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", out[f"median_{name}_ms"])
        for q in percentiles:
            row(f"P{q:g} {name.upper()} (ms):", out[f"p{q:g}_{name}_ms"])
    if sm := out.get("server_metrics"):
        head("Server Prometheus counters (delta)")
        if "error" in sm:
            print(sm["error"])
        else:
            row("prompt_tokens_total:", sm.get("prompt_tokens"), "{:.0f}")
            row("generation_tokens_total:", sm.get("generation_tokens"), "{:.0f}")
            row("Match client token counts:", sm.get("match"))
    print("=" * w)
    if out["slowest_requests"]:
        print("Slowest requests (look them up in the trace backend by trace id):")
        print(
            f"  {'e2e ms':>9} {'TTFT ms':>9} {'TPOT ms':>8} {'status':>7}  trace_id"
            "                          request_id"
        )
        for s in out["slowest_requests"]:
            ttft = "-" if s["ttft_ms"] is None else f"{s['ttft_ms']:.1f}"
            tpot = "-" if s["tpot_ms"] is None else f"{s['tpot_ms']:.2f}"
            print(
                f"  {s['e2el_ms']:>9.1f} {ttft:>9} {tpot:>8} {s['status']:>7}  {s['trace_id']}  "
                f"{s['request_id']}"
            )


# ---------------------------------------------------------------------------------------------
# Main


def _default_result_path(args: argparse.Namespace, model: str, stamp: str) -> Path:
    conc = args.max_concurrency or "inf"
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)[:60]
    return (
        Path(__file__).resolve().parent / "results" / f"bench-{safe}-c{conc}-r{rate}-{stamp}.json"
    )


async def amain(args: argparse.Namespace) -> int:
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    client = Client(args)
    try:
        model = await client.resolve_model()
        run_id = secrets.token_hex(4)
        prefix = (
            args.request_id_prefix if args.request_id_prefix is not None else f"bench-{run_id}-"
        )
        n_warm = max(args.num_warmups, 0)
        total = args.num_prompts + n_warm
        if args.dataset == "random":
            specs = await build_random(client, args, total, args.seed)
        else:
            specs = build_file(args, total, args.seed)
        warm_specs, specs = specs[:n_warm], specs[n_warm:]
        warmup = (
            await warm_up(client, warm_specs, prefix)
            if warm_specs
            else {
                "requests": 0,
                "completed": 0,
                "prompt_tokens": 0,
                "output_tokens": 0,
                "trace_ids": [],
                "failures": {},
            }
        )
        metrics_url = None
        if args.server_metrics is not None:
            metrics_url = args.server_metrics or client.base + "/metrics"
        before = await scrape_settled(client, metrics_url) if metrics_url else None
        started_at = datetime.now(UTC)
        results, duration = await run_benchmark(client, specs, args, prefix)
        after = await scrape_settled(client, metrics_url) if metrics_url else None
    finally:
        await client.aclose()

    out: dict[str, Any] = {
        "date": started_at.isoformat(timespec="seconds"),
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(specs),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prompt_format": args.prompt_format,
        "ignore_eos": args.ignore_eos,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "slo": args.slo,
        "slo_text": ",".join(f"{k}:{v:g}" for k, v in args.slo.items()),
        "percentiles": percentiles,
        "warmup": warmup,
    }
    out.update(compute_metrics(results, duration, args, percentiles))
    if before is not None and after is not None:
        delta = {k: after[k] - before[k] for k in after}
        delta["match"] = (
            delta["prompt_tokens"] == out["total_input_tokens"]
            and delta["generation_tokens"] == out["total_output_tokens"]
            and out["failed"] == 0
        )
        out["server_metrics"] = delta
    elif metrics_url:
        out["server_metrics"] = {"error": f"could not scrape {metrics_url}"}
    out["slowest_requests"] = slowest(results, args.slowest)
    if args.save_detailed:
        out["requests"] = [request_record(r) for r in results]

    print_report(out, percentiles)
    if not args.no_save:
        path = (
            Path(args.result_file)
            if args.result_file
            else _default_result_path(args, model, started_at.strftime("%Y%m%d-%H%M%S"))
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"Result written to {path}")
    if out["completed"] == 0 or (out["failed"] and not args.allow_failures):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    if args.burstiness <= 0:
        raise SystemExit("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
