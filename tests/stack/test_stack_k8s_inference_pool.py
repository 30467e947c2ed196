"""deploy/k8s/inference-pool (issue 36): the InferencePool validates against the extension's
published CRD schema (the v1.6.0 copy in crds/), the built-in kinds against Kubernetes' (strict),
and the pieces meet: the pool selects deploy/k8s's moeserve pods on their REST port, its
endpoint picker reference is the EPP Service and port, the EPP watches that pool and reads the
mounted config, whose profile only names declared plugins. The picker's configs use only plugin
types the pinned picker registers, with parameters its config structs know; the precise
prefix-cache scorer meets the pods as model-servers/kv-events-patch.yaml configures them."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess

import pytest
import yaml
from jsonschema import Draft202012Validator
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest
from stack_support import K8S_DIR, load_yaml_all, metric_families_from_text

from inference.config import EngineConfig
from inference.kv_events import kv_events_config
from telemetry.metrics import ServiceMetrics

POOL_DIR = K8S_DIR / "inference-pool"
(CRD,) = load_yaml_all(POOL_DIR / "crds" / "inference.networking.k8s.io_inferencepools.yaml")
MANIFESTS = {p.name: load_yaml_all(p) for p in sorted(POOL_DIR.glob("*.yaml"))}
OBJECTS = [o for docs in MANIFESTS.values() for o in docs if o["kind"] != "Kustomization"]
BUILTIN = [o for o in OBJECTS if o["kind"] != "InferencePool"]
MOESERVE = next(o for o in load_yaml_all(K8S_DIR / "deployment.yaml") if o["kind"] == "Deployment")
(BASE_HPA,) = load_yaml_all(K8S_DIR / "hpa.yaml")
(BASE_ADAPTER,) = load_yaml_all(K8S_DIR / "prometheus-adapter.yaml")
(BASE_SERVICE,) = load_yaml_all(K8S_DIR / "service.yaml")
KV_EVENTS_PATCH = POOL_DIR / "model-servers" / "kv-events-patch.yaml"

# Plugin types the pinned picker registers, each the value of its Go constant in
# llm-d-inference-scheduler at 520af47896e5 (pkg/epp/framework/plugins/register.go and
# cmd/epp/runner/runner.go register them): the ones this repo's configs may use.
KNOWN_PLUGIN_TYPES = {
    "single-profile-handler",  # scheduling/profilehandler/single/single_profile_handler.go
    "decode-filter",  # scheduling/filter/bylabel/roles.go
    "prefix-cache-scorer",  # scheduling/scorer/prefix/plugin.go
    "precise-prefix-cache-scorer",  # scheduling/scorer/preciseprefixcache/precise_prefix_cache.go
    "load-aware-scorer",  # scheduling/scorer/loadaware/load_aware.go
    "kv-cache-utilization-scorer",  # scheduling/scorer/kvcacheutilization/kvcache_utilization.go
    "queue-scorer",  # scheduling/scorer/queuedepth/queue.go
    "max-score-picker",  # scheduling/picker/maxscore/picker.go
    "token-producer",  # requestcontrol/dataproducer/tokenizer/tokenizer.go
    "endpoint-notification-source",  # datalayer/source/notifications/endpoint_datasource.go
    "metrics-data-source",  # datalayer/source/metrics/datasource.go
    "core-metrics-extractor",  # datalayer/extractor/metrics/factories.go
}
# The parameters each plugin's config struct reads (its json tags): Go's json.Unmarshal drops
# an unknown key silently, so a misspelt one would leave its default in force unnoticed.
# Nested objects: llm-d-kv-cache v0.8.0's kvblock.TokenProcessorConfig, kvevents.Config and
# kvevents.PodDiscoveryConfig; the token producer's vllmConfig (tokenizer/vllm_http.go).
PLUGIN_PARAMETERS = {
    "precise-prefix-cache-scorer": {
        "tokenProcessorConfig": {"blockSize", "hashSeed"},
        "indexerConfig": None,  # kvcache.Config: many backends, checked by the picker
        "kvEventsConfig": {
            "zmqEndpoint",
            "topicFilter",
            "concurrency",
            "engineType",
            "discoverPods",
            "podDiscoveryConfig",
        },
        "speculativeIndexing": None,
        "speculativeTTL": None,
    },
    "token-producer": {
        "modelName": None,
        "vllm": {"http", "timeout", "mmTimeout"},
        "udsTokenizerConfig": None,
    },
}
POD_DISCOVERY_PARAMETERS = {"podLabelSelector", "podNamespace", "socketPort"}


def _one(kind: str) -> dict:
    (found,) = [o for o in OBJECTS if o["kind"] == kind]
    return found


def _crd_schema(version: str) -> dict:
    (served,) = [v for v in CRD["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def test_the_pool_validates_against_the_published_crd():
    pool = _one("InferencePool")
    group, version = pool["apiVersion"].split("/")
    assert (group, pool["kind"]) == (CRD["spec"]["group"], CRD["spec"]["names"]["kind"])
    assert CRD["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    errors = sorted(Draft202012Validator(_crd_schema(version)).iter_errors(pool), key=str)
    assert not errors, [e.message for e in errors]
    broken = yaml.safe_load(yaml.safe_dump(pool))
    del broken["spec"]["targetPorts"]  # the schema is not vacuous: a required field missing
    assert list(Draft202012Validator(_crd_schema(version)).iter_errors(broken))


@pytest.mark.parametrize("obj", BUILTIN, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_builtin_kinds_validate_against_the_kubernetes_schema(obj):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_pool_selects_the_moeserve_pods_on_their_rest_port():
    spec = _one("InferencePool")["spec"]
    labels = MOESERVE["spec"]["template"]["metadata"]["labels"]
    assert set(spec["selector"]["matchLabels"].items()) <= set(labels.items())
    ports = MOESERVE["spec"]["template"]["spec"]["containers"][0]["ports"]
    http = next(p["containerPort"] for p in ports if p["name"] == "http")
    assert spec["targetPorts"] == [{"number": http}]


def test_the_endpoint_picker_serves_the_pool_with_its_config():
    pool = _one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = _one("Service")
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    pod = _one("Deployment")["spec"]["template"]
    assert set(service["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--grpc-port") + 1] == str(ref["port"]["number"])
    config_path = args[args.index("--config-file") + 1]
    (mount,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    (configmap,) = [o for o in OBJECTS if o["metadata"]["name"] == volume["configMap"]["name"]]
    assert configmap["kind"] == "ConfigMap"
    key = config_path.removeprefix(mount["mountPath"] + "/")
    config = yaml.safe_load(configmap["data"][key])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared
    role = _one("Role")
    watched = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"inferencepools", "pods"} <= watched


def test_the_kustomization_lists_every_manifest():
    (kustomization,) = MANIFESTS["kustomization.yaml"]
    assert sorted(kustomization["resources"]) == sorted(
        name for name in MANIFESTS if name != "kustomization.yaml"
    )


def _adapter_rules(configmap: dict) -> list[dict]:
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def test_the_pool_scales_on_its_queue_depth_through_the_adapter():
    """One HPA per pool: it replaces the base's (same name, same Deployment: the pods the
    pool selects) and scales on vllm:num_requests_waiting, which the service exports and the
    pool's adapter rules serve under that name; the adapter rules keep the base's."""
    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["name"] == BASE_HPA["metadata"]["name"]
    assert hpa["spec"]["scaleTargetRef"] == BASE_HPA["spec"]["scaleTargetRef"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == MOESERVE["metadata"]["name"]
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    assert name == "vllm:num_requests_waiting"
    env = {
        e["name"]: e.get("value")
        for e in MOESERVE["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert 0 < float(metric["pods"]["target"]["averageValue"]) < int(env["MOESERVE_MAX_WAITING"])

    adapter = next(o for o in OBJECTS if o["metadata"]["name"] == BASE_ADAPTER["metadata"]["name"])
    rules = _adapter_rules(adapter)
    for rule in _adapter_rules(BASE_ADAPTER):
        assert rule in rules  # the base HPA's metric is still served
    (rule,) = [r for r in rules if r["name"]["as"] == name]
    registry = CollectorRegistry()
    ServiceMetrics(registry, "m", num_layers=2, num_experts=4, max_waiting=8)
    exported = metric_families_from_text(generate_latest(registry).decode())
    (series,) = [f for f in exported if re.fullmatch(rule["name"]["matches"], f)]
    assert series == name and exported[series] == "gauge"
    assert f'"{series}"' in rule["seriesQuery"] or rule["seriesQuery"].startswith(series + "{")
    overrides = rule["resources"]["overrides"]
    assert (overrides["pod"]["resource"], overrides["namespace"]["resource"]) == (
        "pod",
        "namespace",
    )


def test_the_adapter_queries_are_valid_promql(tmp_path):
    """Each rule's metricsQuery, rendered as the adapter renders it for an HPA's pods, passes
    promtool's PromQL parser (as a recording rule)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); check not run")
    adapter = next(o for o in OBJECTS if o["metadata"]["name"] == BASE_ADAPTER["metadata"]["name"])
    rules = []
    for i, rule in enumerate(_adapter_rules(adapter)):
        series = rule["name"]["as"]
        expr = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"moeserve-a|moeserve-b"')
            .replace("<<.GroupBy>>", "pod")
        )
        rules.append({"record": f"adapter:rule{i}", "expr": expr})
    path = tmp_path / "adapter.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": rules}]}))
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def _picker_configs() -> dict[str, dict]:
    (configmap,) = [o for o in OBJECTS if o["metadata"]["name"] == "moeserve-epp-config"]
    return {key: yaml.safe_load(text) for key, text in configmap["data"].items()}


@pytest.mark.parametrize("key", sorted(_picker_configs()))
def test_each_picker_config_uses_known_plugins_and_parameters(key):
    config = _picker_configs()[key]
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    types = [p["type"] for p in config["plugins"]]
    assert len(types) == len(set(types))  # referenced by type: each declared once
    assert set(types) <= KNOWN_PLUGIN_TYPES, set(types) - KNOWN_PLUGIN_TYPES
    for plugin in config["plugins"]:
        allowed = PLUGIN_PARAMETERS.get(plugin["type"], {})
        parameters = plugin.get("parameters", {})
        assert set(parameters) <= set(allowed), (plugin["type"], set(parameters) - set(allowed))
        for name, value in parameters.items():
            if allowed[name] is not None:
                assert set(value) <= allowed[name], (plugin["type"], name, value)
        discovery = parameters.get("kvEventsConfig", {}).get("podDiscoveryConfig", {})
        assert set(discovery) <= POD_DISCOVERY_PARAMETERS
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"]] + [e["pluginRef"] for e in source.get("extractors", [])]
    assert set(refs) <= set(types)
    (profile,) = config["schedulingProfiles"]
    assert profile["plugins"][-1]["pluginRef"] == "max-score-picker"


def _patched_moeserve() -> dict:
    jsonpatch = pytest.importorskip("jsonpatch")
    ops = yaml.safe_load(KV_EVENTS_PATCH.read_text())
    return jsonpatch.apply_patch(MOESERVE, ops)


def _container_args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_picker_runs_the_precise_scorer_as_the_pods_publish_for_it():
    """epp.yaml reads the precise config. Its token producer renders through the moeserve
    Service for the served model; its scorer cuts blocks as the engine does and subscribes to
    each pod's port; the patched pods publish there (a --kv-events-config the server accepts)
    under the topic the scorer keys pods by: kv@<pod IP>:<pool target port>@<served model>."""
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    config_file = container["args"][container["args"].index("--config-file") + 1]
    config = _picker_configs()[config_file.rsplit("/", 1)[1]]
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    scorer = plugins["precise-prefix-cache-scorer"]
    assert "indexerConfig" in scorer  # the factory refuses a config without one

    base_args = _container_args(MOESERVE)
    served = base_args[base_args.index("--served-model-name") + 1]
    producer = plugins["token-producer"]
    assert producer["modelName"] == served  # the render routes 404 another model
    http_port = next(p["port"] for p in BASE_SERVICE["spec"]["ports"] if p["name"] == "http")
    assert producer["vllm"]["http"] == f"http://{BASE_SERVICE['metadata']['name']}:{http_port}"

    engine_block = next(
        f.default for f in dataclasses.fields(EngineConfig) if f.name == "block_size"
    )
    assert scorer["tokenProcessorConfig"]["blockSize"] == engine_block
    events = scorer["kvEventsConfig"]
    assert events["discoverPods"] is True and "zmqEndpoint" not in events
    port = events["podDiscoveryConfig"]["socketPort"]

    patched = _patched_moeserve()
    args = _container_args(patched)
    assert args[: len(base_args)] == base_args  # the patch only adds
    text = args[args.index("--kv-events-config") + 1]
    pod = patched["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # the kubelet expands $(POD_IP) in args; the server then parses what it gets
    published = kv_events_config(text.replace("$(POD_IP)", "10.1.2.3"))
    assert published is not None and published.publishes
    assert published.endpoint == f"tcp://*:{port}"
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports["kv-events"] == port
    (target,) = _one("InferencePool")["spec"]["targetPorts"]
    assert published.topic == f"kv@10.1.2.3:{target['number']}@{served}"
    assert published.topic.startswith(events["topicFilter"])
    assert len(published.topic.split("@")) == 3  # llm-d's parseTopic: kv@<pod>@<model>
    assert json.loads(text)["topic"] == f"kv@$(POD_IP):{target['number']}@{served}"


def test_the_patched_moeserve_deployment_is_valid():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    patched = _patched_moeserve()
    kubernetes_validate.validate(patched, kubernetes_validate.latest_version(), strict=True)


def test_kubectl_applies_the_documented_patch_as_written():
    """The command the docs give (kubectl patch --type json --patch-file), run locally on the
    base Deployment, yields the Deployment the tests above check."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; check not run")
    proc = subprocess.run(
        [
            kubectl,
            "patch",
            "--local",
            "-f",
            str(K8S_DIR / "deployment.yaml"),
            "--type",
            "json",
            "--patch-file",
            str(KV_EVENTS_PATCH),
            "-o",
            "json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == _patched_moeserve()
