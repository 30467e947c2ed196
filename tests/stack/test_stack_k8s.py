"""deploy/k8s: the manifests are valid Kubernetes objects (kubernetes-validate's OpenAPI
schemas, strict, for the built-in kinds; a structural check for the Prometheus Operator
and kustomize kinds), their probes hit real routes, the termination grace period covers
the drain, and the HPA's metric is the one the Prometheus adapter serves."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml
from stack_support import K8S_DIR, load_yaml_all, serve_parser, service_metric_families

MANIFESTS = {p.name: load_yaml_all(p) for p in sorted(K8S_DIR.glob("*.yaml"))}
OBJECTS = [obj for docs in MANIFESTS.values() for obj in docs]
# Kinds the kubernetes-validate schemas do not cover (CRDs, kustomize): checked below.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}


def obj(kind: str, name: str | None = None) -> dict:
    found = [
        o for o in OBJECTS if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name)
    return found[0]


def test_manifests_present():
    kinds = {o["kind"] for o in OBJECTS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodMonitor", "ConfigMap"} <= kinds
    for o in OBJECTS:
        assert o.get("apiVersion") and o.get("kind"), o
        if o["kind"] != "Kustomization":
            assert o["metadata"]["name"], o


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, docs in MANIFESTS.items()
        if any((d["apiVersion"], d["kind"]) not in CUSTOM_KINDS for d in docs)
    ],
)
def test_builtin_kinds_validate_against_the_kubernetes_schema(name):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate for the schema check"
    )
    for doc in MANIFESTS[name]:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        # strict: unknown fields are errors too. Raises ValidationError on a bad object.
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_builtin_kinds_required_fields():
    """The fields these objects cannot do without (also without kubernetes-validate)."""
    dep = obj("Deployment", "moeserve")
    assert dep["apiVersion"] == "apps/v1"
    spec = dep["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = spec["template"]["spec"]["containers"]
    assert container["name"] and container["image"]
    svc = obj("Service", "moeserve")
    assert svc["apiVersion"] == "v1" and svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in ports, port
    hpa = obj("HorizontalPodAutoscaler", "moeserve")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "moeserve")
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def container() -> dict:
    (c,) = obj("Deployment", "moeserve")["spec"]["template"]["spec"]["containers"]
    return c


def app_routes() -> set[str]:
    """The REST app's paths, from the Litestar app service/app.py builds."""
    from service.app import create_app

    try:
        from service.observability import Observability

        observability = Observability.disabled()
    except ImportError:  # pragma: no cover - older service layout
        observability = SimpleNamespace(enabled=False)
    state = SimpleNamespace(
        engine=SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: "")),
        settings=SimpleNamespace(max_body_bytes=1 << 20),
        observability=observability,
        inspector=None,
    )
    app = create_app(state)  # builds the route table only; nothing is served
    return {route.path for route in app.routes}


def test_probes_point_at_real_routes():
    c = container()
    ns = serve_parser().parse_args(c["args"])
    assert ns.command == "serve" and ns.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": ns.port, "grpc": ns.grpc_port}
    routes = app_routes()
    probes = {
        kind: c[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe", "startupProbe")
    }
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for kind, probe in probes.items():
        assert probe["path"] in routes, f"{kind}: {probe['path']} is not a route of the app"
        assert ports[probe["port"]] == ns.port, kind


def test_termination_grace_covers_the_drain():
    pod = obj("Deployment", "moeserve")["spec"]["template"]["spec"]
    c = container()
    env = {e["name"]: e.get("value") for e in c["env"]}
    drain = float(env["MOESERVE_DRAIN_TIMEOUT"])
    assert drain > 0
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    # The grace period runs from the preStop hook: sleep, then SIGTERM and the drain, then
    # a margin to stop the servers and the engine before SIGKILL.
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5
    assert (
        serve_parser().parse_args(["serve", "--drain-timeout", str(drain)]).drain_timeout == drain
    )


def test_hpa_scales_on_waiting_requests_through_the_adapter():
    hpa = obj("HorizontalPodAutoscaler", "moeserve")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert float(metric["pods"]["target"]["averageValue"]) > 0
    config = yaml.safe_load(obj("ConfigMap", "prometheus-adapter-moeserve")["data"]["config.yaml"])
    (rule,) = config["rules"]
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    assert series in service_metric_families(), f"{series} is not a metric the service exports"
    assert series == "moeserve_num_requests_waiting"
    assert rule["name"]["as"] == name
    assert re.fullmatch(rule["name"]["matches"], series)
    overrides = rule["resources"]["overrides"]
    assert (
        overrides["pod"]["resource"] == "pod" and overrides["namespace"]["resource"] == "namespace"
    )
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]
    # Keep the target below the queue bound where requests start getting 429.
    env = {e["name"]: e.get("value") for e in container()["env"]}
    assert float(metric["pods"]["target"]["averageValue"]) < int(env["MOESERVE_MAX_WAITING"])


def test_pod_monitor_scrapes_the_metrics_route():
    pm = obj("PodMonitor", "moeserve")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = obj("Deployment", "moeserve")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container()["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["path"] in app_routes()
    assert set(endpoint) <= {
        "port",
        "path",
        "interval",
        "scrapeTimeout",
        "scheme",
        "honorLabels",
        "relabelings",
        "metricRelabelings",
    }
    to_s = lambda d: float(d.rstrip("s"))
    assert to_s(endpoint["scrapeTimeout"]) <= to_s(endpoint["interval"])


def test_kustomization_lists_every_manifest():
    kust = obj("Kustomization")
    listed = set(kust["resources"])
    assert listed == {n for n in MANIFESTS if n != "kustomization.yaml"}
