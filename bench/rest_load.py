"""Shared by the serving benchmarks: a `moeserve serve` subprocess and a closed-loop load of
concurrent streaming completions against it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]


def start_server(model: Path, flags: list[str], env: dict[str, str], log: Path):
    """Starts `moeserve serve` on free ports; returns (process, base url) once it is ready."""
    argv = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        "0",
        "--grpc-port",
        "-1",
        "--log-format",
        "json",
        *flags,
    ]
    out = log.open("w")
    proc = subprocess.Popen(
        argv, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if '"server started"' in line:
                return proc, f"http://127.0.0.1:{json.loads(line)['rest_port']}"
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    """One SSE completion; returns its completion tokens from the final usage chunk.

    The stream is read in raw chunks and only its tail is parsed: the load generator shares
    the machine with the server, so it does as little per token as it can (aiohttp's C
    parser, no per-event JSON)."""
    tail = b""
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in r.content.iter_any():
            tail = (tail + chunk)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.strip()]
    if events[-1] != b"data: [DONE]":
        raise RuntimeError(f"stream did not end with [DONE]: {tail[-200:]!r}")
    return json.loads(events[-2].removeprefix(b"data: "))["usage"]["completion_tokens"]


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
