"""`make replicas` (bench/replicas.py, issue 36): cores split into one share per replica, and
(slow) two real replicas pinned to their shares behind the real vllm-router, serving through
it; every process stopped on exit."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from bench.replicas import ROUTER, core_shares, replicas


def test_cores_are_split_into_one_share_per_replica():
    assert core_shares(2, range(8)) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert core_shares(3, [0, 1, 2, 3, 4, 5, 6]) == [{0, 1}, {2, 3}, {4, 5}]
    assert core_shares(1, [5, 3]) == [{3, 5}]
    assert core_shares(3, [0, 1]) == [{0}, {1}, {0}]  # fewer cores than replicas: shared


@pytest.mark.slow
@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router (a dev dependency) is missing")
def test_replicas_are_pinned_and_serve_through_the_router(tiny_model_dir):
    serve_args = ["--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "4096"]
    with replicas(str(tiny_model_dir), 2, "round_robin", serve_args=serve_args) as cluster:
        shares = core_shares(2)
        for replica, share in zip(cluster.replicas, shares):
            assert replica.cpus == share
            assert os.sched_getaffinity(replica.server.proc.pid) == share
        body = {"prompt": "Hello", "max_tokens": 2}
        for _ in range(2):
            response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        # each replica names itself (service.instance.id, <hostname>:<port>) on every line,
        # the line of the request the router sent it included
        ids = []
        for replica in cluster.replicas:
            server = replica.server
            finished = server.wait_for_event("request finished", 30)
            own = f"{socket.gethostname()}:{server.rest_port}"
            assert finished["service.instance.id"] == server.started["service.instance.id"] == own
            ids.append(own)
        assert len(set(ids)) == 2
        pids = [r.server.proc.pid for r in cluster.replicas] + [cluster.router.proc.pid]
    for pid in pids:  # all stopped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
