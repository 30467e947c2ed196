"""deploy/k8s/router (issue 36): vLLM's router in front of deploy/k8s's moeserve pods. The
built-in kinds validate against the Kubernetes schema (strict), the router's arguments parse as
vllm-router's own, its selector and port find the moeserve pods, its Role lets it watch them,
and the kustomization lists every manifest."""

from __future__ import annotations

import argparse

import pytest
from stack_support import K8S_DIR, load_yaml_all

from bench.replicas import FAILOVER_ARGS

ROUTER_DIR = K8S_DIR / "router"
MANIFESTS = {p.name: load_yaml_all(p) for p in sorted(ROUTER_DIR.glob("*.yaml"))}
OBJECTS = [o for docs in MANIFESTS.values() for o in docs if o["kind"] != "Kustomization"]
BUILTIN = [o for o in OBJECTS if o["kind"] != "PodMonitor"]  # the Prometheus Operator's kind


def _one(kind: str, objects=OBJECTS) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


FAILOVER_SETTINGS = (
    "retry_max_retries",
    "cb_failure_threshold",
    "cb_timeout_duration_secs",
    "health_check_interval_secs",
    "health_failure_threshold",
)


def _router_args_of(argv: list[str]):
    router_args = pytest.importorskip("vllm_router.router_args", reason="vllm-router missing")
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    return router_args.RouterArgs.from_cli_args(parser.parse_args(argv))


def _router_args():
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    return _router_args_of([a.replace("$(POD_NAMESPACE)", "moeserve") for a in container["args"]])


@pytest.mark.parametrize("obj", BUILTIN, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_builtin_kinds_validate_against_the_kubernetes_schema(obj):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_router_finds_the_moeserve_pods():
    args = _router_args()
    moeserve = _one("Deployment", load_yaml_all(K8S_DIR / "deployment.yaml"))
    pod_labels = moeserve["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery
    assert args.selector and set(args.selector.items()) <= set(pod_labels.items())
    ports = moeserve["spec"]["template"]["spec"]["containers"][0]["ports"]
    http = next(p["containerPort"] for p in ports if p["name"] == "http")
    assert args.service_discovery_port == http
    assert args.service_discovery_namespace == "moeserve"  # its own, from the downward API
    assert args.policy == "cache_aware"


def test_the_router_fails_over_as_the_benchmark_measured():
    """A dead replica: the same retry, circuit-breaker and health-check settings as
    bench/replicas.py runs (and bench/replicas_bench.py's kill run measures)."""
    args = _router_args()
    expected = _router_args_of([str(a) for a in FAILOVER_ARGS])
    for name in FAILOVER_SETTINGS:
        assert getattr(args, name) == getattr(expected, name), name


def test_the_router_may_watch_pods_and_is_served():
    role, binding = _one("Role"), _one("RoleBinding")
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    account = _one("ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod = _one("Deployment")["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == account
    service = _one("Service")
    assert set(service["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
    names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_prometheus_scrapes_the_routers_own_metrics():
    monitor = _one("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod = _one("Deployment")["spec"]["template"]
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(
        pod["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert ports[endpoint["port"]] == _router_args().prometheus_port


def test_the_kustomization_lists_every_manifest():
    (kustomization,) = MANIFESTS["kustomization.yaml"]
    assert sorted(kustomization["resources"]) == sorted(
        name for name in MANIFESTS if name != "kustomization.yaml"
    )
