"""deploy/docker-compose.replicas.yml (issue 36), checked without Docker: each replica's command
parses as `moeserve serve` flags with a --kv-events-config that publishes, the router's command
parses as vllm-router's own arguments (its RouterArgs validation included), and every worker
and event source it names is a replica's service, port and endpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from stack_support import serve_parser

from bench.replicas import FAILOVER_ARGS
from inference.config import EngineConfig
from inference.kv_events import kv_events_config

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.replicas.yml"
DOC = yaml.safe_load(COMPOSE.read_text())
SERVICES = DOC["services"]
REPLICAS = sorted(name for name in SERVICES if name.startswith("replica-"))


def _serve_args(name: str) -> argparse.Namespace:
    return serve_parser().parse_args(SERVICES[name]["command"])


def test_two_replicas_and_the_router():
    assert REPLICAS == ["replica-1", "replica-2"]
    assert "router" in SERVICES
    assert SERVICES["router"]["ports"] == ["${MOESERVE_REST_PORT:-8000}:8000"]


@pytest.mark.parametrize("name", REPLICAS)
def test_each_replica_publishes_its_kv_events(name):
    args = _serve_args(name)
    config = kv_events_config(args.kv_events_config)
    assert config is not None and config.publishes
    assert config.endpoint == "tcp://*:5557" and config.replay_endpoint == "tcp://*:5558"
    exposed = set(SERVICES[name]["expose"])
    assert {"8000", "5557", "5558"} <= exposed and args.port == 8000
    env = SERVICES[name]["environment"]
    assert env["OMP_NUM_THREADS"] == SERVICES[name]["cpus"]  # threads match the cpu share
    # named as Prometheus' instance label and the router's worker URL name it
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"service.instance.id={name}:{args.port}"


def test_the_routers_command_is_vllm_routers_own():
    router_args = pytest.importorskip("vllm_router.router_args", reason="vllm-router missing")
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    command = [
        c.replace("${ROUTER_POLICY:-kv_aware}", "kv_aware") for c in SERVICES["router"]["command"]
    ]
    ns = parser.parse_args(command)
    args = router_args.RouterArgs.from_cli_args(ns)
    assert args.policy == "kv_aware" and args.port == 8000
    # a dead replica is handled as bench/replicas.py's router handles it (FAILOVER_ARGS)
    failover = router_args.RouterArgs.from_cli_args(
        parser.parse_args([str(a) for a in FAILOVER_ARGS])
    )
    for name in ("retry_max_retries", "cb_failure_threshold", "health_check_interval_secs"):
        assert getattr(args, name) == getattr(failover, name), name
    assert (args.prometheus_host, args.prometheus_port) == ("0.0.0.0", 29000)
    assert str(args.prometheus_port) in SERVICES["router"]["expose"]
    assert args.worker_urls == [f"http://{r}:8000" for r in REPLICAS]
    sources = dict(s.split("=", 1) for s in args.kv_event_source)
    replays = dict(s.split("=", 1) for s in args.kv_event_replay_source)
    assert sources == {f"http://{r}:8000": f"tcp://{r}:5557" for r in REPLICAS}
    assert replays == {f"http://{r}:8000": f"tcp://{r}:5558" for r in REPLICAS}
    # the router tokenizes with the model the replicas serve, from the image it is built on
    assert args.kv_event_model == _serve_args("replica-1").model
    assert args.kv_event_block_size == EngineConfig().block_size  # the replicas' blocks
    assert json.loads(json.dumps(SERVICES["router"]["depends_on"])) == {
        r: {"condition": "service_healthy"} for r in REPLICAS
    }
