"""`make bench`, access control: a key that floods the server gets 429s while another key's
time to first token stays near its unloaded baseline (target: median TTFT within 1.5x).

One `moeserve serve` (bench/harness.py's ServerProcess) with three named keys:

- `flood`: max_concurrent 2 (its limit); --flood-workers clients send streaming requests with
  it as fast as they can, --backoff-s after each 429 (a runaway client, not a polite one);
- `flood-open`: the same flood on a key without limits, so the waiting queue fills up;
- `steady`: one client, one request at a time, whose TTFT (request sent -> first SSE event)
  is measured.

Each round measures the steady client's TTFT in four phases, each on fresh random prompts (no
prefix-cache hits): `baseline` alone; `limited` beside the `flood` key; under the unlimited
flood, once with its own key (`own_key`: the scheduler admits the keys' requests in turn) and
once sending with the flooder's key (`shared_key`: one tenant, so first come first served,
behind the queued flood). Rounds repeat the phases so that the drift of a shared machine hits
all of them; the ratios are of median TTFTs over all rounds. Results in
bench/results/access_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.harness import ServerProcess
from bench.machine import cpu_name
from inference.checkpoints.demo_model import ensure_demo_model

RESULTS = Path(__file__).parent / "results"
KEYS = {"flood": "sk-bench-flood", "flood-open": "sk-bench-flood-open", "steady": "sk-bench-steady"}
PHASES = ("baseline", "limited", "own_key", "shared_key")
TARGET = 1.5  # limited / baseline, median TTFT


def _auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


class Load:
    """Streaming completion bodies on fresh random prompts."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def body(self, prompt_len: int, max_tokens: int) -> dict:
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)]
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }


async def first_token_s(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> float:
    """Seconds from sending the request to its first SSE event; the stream is read to its end."""
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=_auth(key)) as r:
        if r.status != 200:
            raise RuntimeError(f"{key}: HTTP {r.status}: {(await r.text())[:200]}")
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - started
    return first


async def flood(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    load: Load,
    args: argparse.Namespace,
    stop: asyncio.Event,
    counts: dict[str, int],
) -> None:
    """One runaway client: requests back to back, BACKOFF_S after a 429."""
    while not stop.is_set():
        body = load.body(args.flood_prompt_len, args.flood_output_len)
        async with session.post(url + "/v1/completions", json=body, headers=_auth(key)) as r:
            if r.status == 429:
                counts["rejected"] += 1
                await r.read()
                await asyncio.sleep(args.backoff_s)
                continue
            if r.status != 200:
                raise RuntimeError(f"flood: HTTP {r.status}: {(await r.text())[:200]}")
            async for _ in r.content.iter_any():
                pass
            counts["completed"] += 1


async def phase(url: str, name: str, load: Load, args: argparse.Namespace) -> dict:
    """The steady client's TTFTs in one phase, beside its flood (if any)."""
    flood_key = {"limited": "flood", "own_key": "flood-open", "shared_key": "flood-open"}.get(name)
    steady_key = "flood-open" if name == "shared_key" else "steady"
    counts = {"completed": 0, "rejected": 0}
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=args.flood_workers + 2)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        workers = []
        if flood_key:
            workers = [
                asyncio.ensure_future(flood(session, url, flood_key, load, args, stop, counts))
                for _ in range(args.flood_workers)
            ]
            await asyncio.sleep(args.settle_s)  # the flood reaches its steady state
        ttfts = []
        try:
            for _ in range(args.requests):
                body = load.body(args.prompt_len, args.output_len)
                ttfts.append(await first_token_s(session, url, steady_key, body))
                await asyncio.sleep(args.gap_s)
        finally:
            stop.set()
            await asyncio.gather(*workers)
    return {"ttft_s": ttfts, "flood": counts if flood_key else None}


def _keys_file(path: Path) -> Path:
    keys = [
        {"name": "flood", "key": KEYS["flood"], "max_concurrent": 2},
        {"name": "flood-open", "key": KEYS["flood-open"]},
        {"name": "steady", "key": KEYS["steady"]},
    ]
    path.write_text(json.dumps({"keys": keys}))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6, help="steady requests per phase")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--flood-workers", type=int, default=16)
    parser.add_argument("--flood-prompt-len", type=int, default=32)
    parser.add_argument("--flood-output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--backoff-s", type=float, default=0.25, help="flood's pause after a 429")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--gap-s", type=float, default=0.2, help="between steady requests")
    args = parser.parse_args(argv)
    model = ensure_demo_model(args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    flags = ["--device", args.device, "--dtype", "bfloat16"]
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024"]
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        keys = _keys_file(Path(tmp) / "keys.json")
        with ServerProcess(
            model,
            *flags,
            "--api-keys-file",
            keys,
            env={"OTEL_TRACES_EXPORTER": "none"},
            log_path=Path(tmp) / "server.log",
            start_timeout=300,
            stop_timeout=60,
        ) as server:
            load = Load(vocab, seed=0)
            asyncio.run(phase(server.url, "baseline", load, args))  # warm-up, not kept
            for r in range(args.rounds):
                result = {name: asyncio.run(phase(server.url, name, load, args)) for name in PHASES}
                rounds.append(result)
                medians = {n: statistics.median(result[n]["ttft_s"]) * 1e3 for n in PHASES}
                print(
                    f"round {r}: median TTFT ms "
                    + ", ".join(f"{n} {m:.0f}" for n, m in medians.items())
                    + f"; flood key: {result['limited']['flood']}",
                    flush=True,
                )
    median = {n: statistics.median(t for r in rounds for t in r[n]["ttft_s"]) for n in PHASES}
    limited = {k: sum(r["limited"]["flood"][k] for r in rounds) for k in ("completed", "rejected")}
    ratio = median["limited"] / median["baseline"]
    print(
        f"TTFT of a second key beside a flooding key: median {median['limited'] * 1e3:.0f} ms "
        f"against {median['baseline'] * 1e3:.0f} ms alone -> ratio {ratio:.2f} (target <= "
        f"{TARGET}); the flooding key got {limited['rejected']} 429s and completed "
        f"{limited['completed']} requests (max_concurrent 2)"
    )
    print(
        f"fair share, unlimited flood: own key {median['own_key'] * 1e3:.0f} ms "
        f"({median['own_key'] / median['baseline']:.2f}x), the flooder's key "
        f"{median['shared_key'] * 1e3:.0f} ms ({median['shared_key'] / median['baseline']:.2f}x)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "access_bench.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "cpu": cpu_name(),
                "machine": platform.platform(),
                "median_ttft_s": median,
                "ratio_limited": ratio,
                "ratio_own_key": median["own_key"] / median["baseline"],
                "ratio_shared_key": median["shared_key"] / median["baseline"],
                "flood_limited": limited,
                "rounds": rounds,
                "config": {k: str(v) for k, v in vars(args).items()},
            },
            indent=2,
        )
    )
    return 0 if limited["rejected"] > 0 else 1  # no 429 at all: the flood did not flood


if __name__ == "__main__":
    sys.exit(main())
