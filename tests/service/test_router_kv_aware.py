"""vLLM's router under kv_aware routes on our KV-cache events (issue 36): two `moeserve serve`
replicas publish with --kv-events-config, the router subscribes (--kv-event-source, with the
replay sockets), and a prompt whose prefix one replica already holds goes to that replica. Each
replica is first given its own prompt directly, so the router can only know where a prefix is
from the events; the router learns a request's token ids by asking each replica to render it
(vLLM's /v1/chat/completions/render, /v1/completions/render). Completions with a repeated
prefix, and multi-turn chats whose history grows each turn. Processes started and stopped by
the test."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import HOST, ManagedProcess, ServerProcess, free_port, wait_until

ROUTER = Path(sys.executable).with_name("vllm-router")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing"),
]


def _served(server: ServerProcess) -> float:
    """Requests the replica finished (its moeserve_requests_total)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "moeserve_requests"
        for s in family.samples
        if s.name == "moeserve_requests_total"
    )


@contextmanager
def _kv_aware_router(replicas, sources, model_dir) -> Iterator[tuple[str, str]]:
    """vllm-router under kv_aware in front of `replicas`, subscribed to their events (with
    replay): (its URL, its /metrics URL)."""
    port, metrics_port = free_port(), free_port()
    argv = [
        ROUTER, "--host", HOST, "--port", port, "--policy", "kv_aware",
        "--prometheus-host", HOST, "--prometheus-port", metrics_port,
        "--worker-urls", *(s.url for s in replicas),
        "--kv-event-model", model_dir, "--kv-event-block-size", 16,
    ]  # fmt: skip
    for server, (events, replay) in zip(replicas, sources):
        argv += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{events}"]
        argv += ["--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay}"]
    with ManagedProcess(argv, stop_timeout=10, name="vllm-router") as router:
        url = f"http://{HOST}:{port}"
        try:
            wait_until(lambda: httpx.get(url + "/v1/models").status_code == 200, 60, "router")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; vllm-router's log:\n{router.tail()}") from None
        yield url, f"http://{HOST}:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[tuple[list[ServerProcess], str, str, Callable]]:
    with ExitStack() as stack:
        replicas, sources = [], []
        for _ in range(2):
            events, replay = free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            server = ServerProcess(
                tiny_model_dir,
                "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
                "--kv-cache-tokens", "8192", "--kv-events-config", json.dumps(config),
                start_timeout=180,
                stop_timeout=20,
            )  # fmt: skip
            stack.callback(server.stop)
            server.start()
            replicas.append(server)
            sources.append((events, replay))
        for server in replicas:
            server.wait_ready()
        another = partial(_kv_aware_router, replicas, sources, str(tiny_model_dir))
        url, metrics = stack.enter_context(another())
        yield replicas, url, metrics, another


def test_kv_aware_sends_a_prefix_to_the_replica_that_stored_it(cluster):
    replicas, url, _, _ = cluster
    prefixes = [
        " ".join(f"{word}{i}" for i in range(120)) for word in ("alpha", "omega")
    ]  # about 480 tokens each: 30 blocks
    for prefix, replica in zip(prefixes, reversed(replicas)):  # the second replica first
        direct = {"prompt": prefix + " start", "max_tokens": 2}
        assert httpx.post(replica.url + "/v1/completions", json=direct, timeout=60).is_success
    time.sleep(1.0)  # the events reach the router's index
    with httpx.Client(base_url=url, timeout=60) as http:
        for prefix, holder in zip(prefixes, reversed(replicas)):
            before = [_served(r) for r in replicas]
            for turn in range(3):
                body = {"prompt": f"{prefix} turn {turn}", "max_tokens": 2}
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            after = [_served(r) for r in replicas]
            gained = [a - b for a, b in zip(after, before)]
            assert gained[replicas.index(holder)] == 3, (gained, holder.url)


def _router_counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_kv_aware_keeps_each_chat_on_the_replica_holding_its_history(cluster):
    """Multi-turn chat, as bench/replicas_bench.py sends it: each conversation's first turn
    goes straight to one replica, every later turn (its whole history again, plus a new user
    message) through the router, which renders the chat on each replica
    (/v1/chat/completions/render) and finds the history's blocks among that replica's events."""
    replicas, url, metrics, _ = cluster
    rendered_before = _router_counter(
        metrics, "vllm_router_kv_routing_inputs_total", result="render"
    )
    system = {"role": "system", "content": "You answer briefly. " + " ".join(["rule"] * 40)}
    for c, holder in enumerate([replicas[1], replicas[0], replicas[1]]):
        history = [system, {"role": "user", "content": " ".join(f"q{c}w{i}" for i in range(60))}]
        body = {"messages": history, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        first = httpx.post(holder.url + "/v1/chat/completions", json=body, timeout=60).json()
        history.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
        time.sleep(1.0)  # the events reach the router's index
        for turn in range(1, 3):
            history.append({"role": "user", "content": f"and then {turn}? " * 20})
            before = [_served(r) for r in replicas]
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            gained = [a - b for a, b in zip([_served(r) for r in replicas], before)]
            assert gained[replicas.index(holder)] == 1, (c, turn, gained, holder.url)
            reply = response.json()["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": reply})
            time.sleep(0.5)
    rendered = _router_counter(metrics, "vllm_router_kv_routing_inputs_total", result="render")
    assert rendered - rendered_before == 2 * 3 * 2  # every replica rendered every routed turn
    assert _router_counter(metrics, "vllm_router_kv_placement_lookups_total", result="hit") > 0


def test_a_router_started_after_the_replicas_served_learns_their_blocks_by_replay(cluster):
    """The replicas publish before this router subscribes: its first live batch from each
    shows it a gap, and the replay socket (current vLLM's frames: topic, sequence, batch)
    fills in what came before, so a prefix stored earlier is found, and so are the later
    blocks chained onto it."""
    replicas, _, _, another = cluster
    prefix = " ".join(f"early{i}" for i in range(120))
    holder = replicas[1]
    direct = {"prompt": prefix + " start", "max_tokens": 2}
    assert httpx.post(holder.url + "/v1/completions", json=direct, timeout=60).is_success
    with another() as (url, metrics):
        for n, replica in enumerate(replicas):  # a live batch from each: the gap shows
            other = {"prompt": " ".join(f"live{n}x{i}" for i in range(40)), "max_tokens": 1}
            assert httpx.post(replica.url + "/v1/completions", json=other, timeout=60).is_success
        time.sleep(1.5)  # the replays reach the router's index
        for turn in range(2):
            before = [_served(r) for r in replicas]
            body = {"prompt": f"{prefix} late {turn}", "max_tokens": 2}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
            gained = [a - b for a, b in zip([_served(r) for r in replicas], before)]
            assert gained[replicas.index(holder)] == 1, (turn, gained)
        assert _router_counter(metrics, "vllm_router_kv_placement_lookups_total", result="hit")
