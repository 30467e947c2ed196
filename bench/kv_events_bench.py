"""`make bench`, what publishing KV-cache events costs (issue 36; target: under 1% of decode
throughput): the same engine decodes the same kind of batch with events off and on, in
alternating rounds (ABBA), and the cost is 1 - the median of the per-pair on/off throughput
ratios, so the drift of a shared VM hits both sides of each pair.

  Off: the block manager records nothing (as without --kv-events-config).
  On:  it records, and after every step the engine core's own code takes the events and queues
       one KVEventBatch on a real ZmqEventPublisher (its thread encodes and sends them on a
       TCP PUB socket, with a replay socket and a subscriber connected and draining).

Every round uses fresh prompts, so blocks are stored and, once the small cache is full,
evicted: each round publishes stores and removals. Writes bench/results/kv_events.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import threading
import time
from pathlib import Path

import zmq

from bench.harness import free_port
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import ensure_demo_model
from inference.engine_core import EngineCore
from inference.kv_event_publisher import ZmqEventPublisher
from inference.kv_events import kv_events_config

RESULTS = Path(__file__).resolve().parent / "results" / "kv_events.json"


def _drain(port: int, stop: threading.Event, received: list[int]) -> None:
    """A subscriber keeping up with the publisher (as a router would)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            received[0] += 1
    sub.close(linger=0)


def _round(engine: LLMEngine, core: EngineCore | None, prompts, max_tokens: int) -> float:
    """Decodes the batch to completion; tokens per second."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", None, params, prompt_token_ids=ids)
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished:
        _, stats = engine.step()
        tokens += stats.num_generated_tokens
        if core is not None:
            core._publish_kv_events()  # the engine core's per-step path
    return tokens / (time.perf_counter() - start)


def measure(
    model_dir: str,
    rounds: int = 6,
    batch: int = 16,
    prompt_len: int = 256,
    max_tokens: int = 64,
    kv_cache_tokens: int = 16384,
    dtype: str = "bfloat16",
) -> dict:
    engine = LLMEngine.from_pretrained(
        model_dir, "cpu", dtype, kv_cache_tokens=kv_cache_tokens, max_num_seqs=batch
    )
    rng = random.Random(0)
    vocab = engine.args.vocab_size

    def prompts():
        return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]

    port, replay = free_port(), free_port()
    config = kv_events_config(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
        )
    )
    publisher = ZmqEventPublisher(config)
    core = EngineCore(engine, None, None, None, publisher)
    stop, received = threading.Event(), [0]
    drain = threading.Thread(target=_drain, args=(port, stop, received), daemon=True)
    drain.start()
    _round(engine, None, prompts(), 4)  # warm-up, untimed
    pairs = []
    try:
        for i in range(rounds):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")  # ABBA
            rates = {}
            for arm in order:
                if arm == "on":
                    engine.block_manager.record_events()
                    rates[arm] = _round(engine, core, prompts(), max_tokens)
                else:
                    engine.block_manager.events = None
                    rates[arm] = _round(engine, None, prompts(), max_tokens)
            pairs.append(rates)
    finally:
        publisher.shutdown()
        stop.set()
        drain.join(2)
    ratios = [p["on"] / p["off"] for p in pairs]
    ratio = statistics.median(ratios)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "workload": {
            "batch": batch,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "kv_cache_tokens": kv_cache_tokens,
            "dtype": dtype,
            "rounds": rounds,
        },
        "rounds": pairs,
        "on_over_off": ratio,
        "cost_fraction": 1 - ratio,
        "batches_received": received[0],
        "batches_dropped": publisher.dropped,
        "target": "cost_fraction < 0.01",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="demo model size")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    result = measure(
        str(ensure_demo_model(args.preset)), args.rounds, args.batch, max_tokens=args.max_tokens
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"KV events on/off decode throughput: {result['on_over_off']:.4f} "
        f"(cost {100 * result['cost_fraction']:.2f}%, target < 1%); "
        f"{result['batches_received']} batches received -> {RESULTS}"
    )


if __name__ == "__main__":
    main()
