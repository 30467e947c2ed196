"""Shared by the serving benchmarks: a closed-loop load of concurrent streaming completions
against a `moeserve serve` subprocess (bench/harness.py's ServerProcess)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from bench.harness import SseError, decode_sse


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    """One SSE completion; returns its completion tokens from the final usage chunk.

    The stream is read in raw chunks and only its tail is parsed: the load generator shares
    the machine with the server, so it does as little per token as it can (aiohttp's C
    parser, no per-event JSON: only the last two events go through harness.decode_sse)."""
    tail = b""
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in r.content.iter_any():
            tail = (tail + chunk)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.strip()]
    if decode_sse(events[-1]) is not None:
        raise SseError(f"stream did not end with data: [DONE]: {tail[-200:]!r}")
    return decode_sse(events[-2])["usage"]["completion_tokens"]


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    """`concurrency` clients work through `bodies`; returns (seconds, output tokens)."""
    pending = list(reversed(bodies))
    tokens = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:

        async def worker() -> None:
            nonlocal tokens
            while pending:
                done = await stream_completion(session, url, pending.pop())
                tokens += done

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, tokens


def streaming_body(prompt, max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
