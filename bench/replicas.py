"""N local `moeserve serve` replicas behind vLLM's router (`make replicas`, REPLICAS=2; issue 36).

Each replica is pinned to its own share of this machine's cores (its engine threads too:
OMP_NUM_THREADS), publishes its KV-cache events in vLLM's format (--kv-events-config, ZMQ on
127.0.0.1), and `vllm-router` (pip vllm-router, a dev dependency) listens on --port in front of
them with --policy (kv_aware subscribes to the replicas' events). Ctrl-C stops everything.

    python -m bench.replicas --replicas 2 --model demo --policy cache_aware --port 8000

`replicas(...)` is the same as a context manager, for benchmarks and tests; `start_router(...)`
puts one more router (another policy) in front of replicas already running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import HOST, ManagedProcess, ServerProcess, free_port, wait_until

ROUTER = Path(sys.executable).with_name("vllm-router")
POLICIES = ("cache_aware", "kv_aware", "power_of_two", "round_robin", "random")

# What the router does when a replica dies (vllm-router 0.1.17's defaults: a health check a
# minute, the circuit opening after 10 failures): a retry could pick the dead replica again
# (cache_aware sends a conversation where its prefix is) and fail the request. Two failures
# open the circuit, and retries, chosen again by the policy, then skip it; health checks every
# 5 s take it out of the worker list. deploy/k8s/router and docker-compose.replicas.yml run
# the router with the same flags.
FAILOVER_ARGS = (
    "--retry-max-retries", 4, "--cb-failure-threshold", 2, "--cb-timeout-duration-secs", 30,
    "--health-check-interval-secs", 5, "--health-failure-threshold", 2,
)  # fmt: skip


@dataclass
class Replica:
    server: ServerProcess
    cpus: set[int]
    events: str  # the ZMQ PUB endpoint subscribers connect to
    replay: str


@dataclass
class Cluster:
    replicas: list[Replica]
    router: ManagedProcess
    url: str  # the router's
    router_metrics: str  # the router's own Prometheus endpoint (--prometheus-port)


def core_shares(replicas: int, cpus: Sequence[int] | None = None) -> list[set[int]]:
    """This process's cores split into `replicas` contiguous shares (a share repeats cores only
    where there are fewer cores than replicas)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if replicas <= len(cpus):
        size = len(cpus) // replicas
        return [set(cpus[i * size : (i + 1) * size]) for i in range(replicas)]
    return [{cpus[i % len(cpus)]} for i in range(replicas)]


def _start_pinned(server: ServerProcess, cpus: set[int]) -> None:
    """Starts `server` with `cpus` as its affinity, which its engine core inherits."""
    ours = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        server.start()
    finally:
        os.sched_setaffinity(0, ours)


@contextmanager
def replicas(
    model: str,
    count: int = 2,
    policy: str = "cache_aware",
    port: int = 0,
    serve_args: Sequence[str] = (),
    start_timeout: float = 300.0,
    metrics_port: int = 0,
    router_args: Sequence[str | int] = FAILOVER_ARGS,
) -> Iterator[Cluster]:
    if not ROUTER.exists():
        raise SystemExit("vllm-router is missing: pip install vllm-router (a dev dependency)")
    with ExitStack() as stack:
        started = []
        for cpus in core_shares(count):
            events, replay = free_port(), free_port()
            config = {  # vLLM's rule binds a PUB endpoint given with a wildcard
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://{HOST}:{replay}",
            }
            server = ServerProcess(
                model,
                "--kv-events-config", json.dumps(config), *serve_args,
                env={"OMP_NUM_THREADS": str(len(cpus))},
                start_timeout=start_timeout,
                stop_timeout=30,
            )  # fmt: skip
            stack.callback(server.stop)
            _start_pinned(server, cpus)
            started.append(
                Replica(server, cpus, f"tcp://{HOST}:{events}", f"tcp://{HOST}:{replay}")
            )
        for replica in started:
            replica.server.wait_ready()
        router, url, metrics = start_router(started, model, policy, port, metrics_port, router_args)
        stack.callback(router.stop)
        yield Cluster(started, router, url, metrics)


def start_router(
    workers: Sequence[Replica],
    model: str,
    policy: str,
    port: int = 0,
    metrics_port: int = 0,
    router_args: Sequence[str | int] = FAILOVER_ARGS,
) -> tuple[ManagedProcess, str, str]:
    """vllm-router with `policy` in front of `workers` (kv_aware: subscribed to their KV events,
    tokenizing with `model`'s folder), ready: (its process, its URL, its own /metrics URL). The
    caller stops it; a benchmark starts one per policy in front of the same replicas."""
    router_port = port or free_port()
    metrics_port = metrics_port or free_port()
    argv = [
        ROUTER, "--host", HOST, "--port", router_port, "--policy", policy,
        "--prometheus-host", HOST, "--prometheus-port", metrics_port,
        "--worker-urls", *(r.server.url for r in workers), *router_args,
    ]  # fmt: skip
    if policy == "kv_aware":
        argv += ["--kv-event-model", model, "--kv-event-block-size", 16]
        for r in workers:
            argv += ["--kv-event-source", f"{r.server.url}={r.events}"]
            argv += ["--kv-event-replay-source", f"{r.server.url}={r.replay}"]
    router = ManagedProcess(argv, stop_timeout=10, name="vllm-router")
    router.start()
    url = f"http://{HOST}:{router_port}"
    try:
        wait_until(lambda: httpx.get(url + "/v1/models").status_code == 200, 60, "router ready")
    except AssertionError as exc:
        tail = router.tail()
        router.stop()
        raise AssertionError(f"{exc}; vllm-router's log:\n{tail}") from None
    except BaseException:
        router.stop()
        raise
    return router, url, f"http://{HOST}:{metrics_port}/metrics"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", "2")))
    parser.add_argument("--model", default=os.environ.get("MODEL") or "demo")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--metrics-port", type=int, default=29000, help="the router's own Prometheus metrics"
    )
    args, serve_args = parser.parse_known_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    if args.policy == "kv_aware" and not Path(args.model).is_dir():
        parser.error("kv_aware tokenizes with the model's folder: give --model a checkpoint folder")
    with replicas(
        args.model,
        args.replicas,
        args.policy,
        args.port,
        serve_args,
        metrics_port=args.metrics_port,
    ) as cluster:
        for i, r in enumerate(cluster.replicas):
            cores = ",".join(map(str, sorted(r.cpus)))
            print(f"replica {i}: {r.server.url} cores {cores} kv events {r.events}", flush=True)
        print(f"vllm-router ({args.policy}): {cluster.url}/v1  (Ctrl-C stops all)", flush=True)
        print(f"vllm-router metrics: {cluster.router_metrics}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
