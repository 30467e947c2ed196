"""deploy/docker-compose.yml and the configs it mounts, checked without Docker: the
compose model, pinned images, published ports, volumes, health checks, and that every
address one component uses for another matches what that one listens on. The OTel
Collector, Tempo and Loki configs are checked against their documented structure.
(`promtool check config` and `amtool check-config` run in tests/alerting/test_alert_rules.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from stack_support import (
    COLLECTOR_YML,
    COMPOSE_CUDA_YML,
    COMPOSE_YML,
    DATASOURCES_YML,
    DEPLOY,
    LOKI_YML,
    PROMETHEUS_YML,
    ROOT,
    TEMPO_YML,
    load_yaml,
    real_log_line,
    serve_parser,
)

COMPOSE = load_yaml(COMPOSE_YML)
SERVICES = COMPOSE["services"]
COLLECTOR = load_yaml(COLLECTOR_YML)
TEMPO = load_yaml(TEMPO_YML)
LOKI = load_yaml(LOKI_YML)

# The compose specification's top-level and service keys used here.
COMPOSE_TOP = {"name", "services", "volumes", "networks", "configs", "secrets", "include"}
SERVICE_KEYS = {
    "build",
    "image",
    "command",
    "entrypoint",
    "environment",
    "ports",
    "expose",
    "volumes",
    "healthcheck",
    "depends_on",
    "logging",
    "restart",
    "user",
    "stop_grace_period",
    "pull_policy",
    "deploy",
    "networks",
    "labels",
    "working_dir",
}
# One container per component the issue names (init helpers aside).
REQUIRED = {
    "moeserve",
    "otel-collector",
    "tempo",
    "loki",
    "prometheus",
    "alertmanager",
    "anomaly-webhook",
    "grafana",
}
# Services that cannot or need not carry a Docker health check, and why.
NO_HEALTHCHECK = {
    "otel-collector": "scratch image without a shell or HTTP client (health_check extension "
    "on :13133, scraped by Prometheus)",
    "tempo-init": "one-shot volume ownership fix",
}


def listen_port(service: str) -> set[int]:
    """The ports a compose service listens on, from its own configuration."""
    if service == "moeserve":
        ns = serve_parser().parse_args(SERVICES["moeserve"]["command"])
        return {ns.port, ns.grpc_port}
    if service == "anomaly-webhook":
        return {serve_parser().parse_args(SERVICES[service]["command"]).port}
    if service == "otel-collector":
        ports = {
            port_of(p["endpoint"]) for p in COLLECTOR["receivers"]["otlp"]["protocols"].values()
        }
        ports.add(port_of(COLLECTOR["extensions"]["health_check"]["endpoint"]))
        reader = COLLECTOR["service"]["telemetry"]["metrics"]["readers"][0]
        ports.add(reader["pull"]["exporter"]["prometheus"]["port"])
        return ports
    if service == "tempo":
        otlp = TEMPO["distributor"]["receivers"]["otlp"]["protocols"]
        return {
            TEMPO["server"]["http_listen_port"],
            *(port_of(p["endpoint"]) for p in otlp.values()),
        }
    if service == "loki":
        return {LOKI["server"]["http_listen_port"]}
    # Upstream defaults (no flag changes them in the compose file).
    return {"prometheus": {9090}, "alertmanager": {9093}, "grafana": {3000}}[service]


def split_volume(volume: str) -> tuple[str, str, list[str]]:
    """SOURCE:TARGET[:MODE] of a short-syntax volume; SOURCE may be ${VAR:-default}."""
    head = ""
    if volume.startswith("${"):
        end = volume.index("}") + 1
        head, volume = volume[:end], volume[end:]
    source, target, *mode = volume.split(":")
    return head + source, target, mode


def port_of(address: str) -> int:
    if "://" in address:
        parsed = urlsplit(address)
        return parsed.port or {"http": 80, "https": 443}[parsed.scheme]
    return int(address.rsplit(":", 1)[1])


def host_port(address: str) -> tuple[str, int]:
    if "://" not in address:
        address = "tcp://" + address
    parsed = urlsplit(address)
    return parsed.hostname, port_of(address)


def assert_reaches(address: str, what: str) -> None:
    host, port = host_port(address)
    assert host in SERVICES, f"{what}: {address} names no compose service"
    assert port in listen_port(host), f"{what}: {host} does not listen on {port}"


# --------------------------------------------------------------------------- compose model


def test_compose_model():
    assert {k for k in COMPOSE if not k.startswith("x-")} <= COMPOSE_TOP
    assert REQUIRED <= set(SERVICES)
    for name, svc in SERVICES.items():
        assert set(svc) <= SERVICE_KEYS, (name, set(svc) - SERVICE_KEYS)
        assert "image" in svc or "build" in svc, name
        for dep in svc.get("depends_on", {}):
            assert dep in SERVICES, (name, dep)


def test_docker_compose_config_if_available():
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run(
            [docker, "compose", "version"], check=False, capture_output=True
        ).returncode
    ):
        pytest.skip("docker compose not installed here; the compose model is checked above")
    proc = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_YML), "config", "--quiet"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_images_are_pinned():
    for name, svc in SERVICES.items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: image {image!r} is not pinned"
        assert re.fullmatch(r"v?\d+\.\d+\.\d+(-[\w.]+)?", tag), f"{name}: {image}"


def test_only_grafana_and_the_api_ports_are_published():
    published = {name: svc["ports"] for name, svc in SERVICES.items() if svc.get("ports")}
    assert set(published) == {"grafana", "moeserve"}
    container_ports = {
        n: {int(str(p).rsplit(":", 1)[1]) for p in ports} for n, ports in published.items()
    }
    assert container_ports["grafana"] == {3000}
    ns = serve_parser().parse_args(SERVICES["moeserve"]["command"])
    assert container_ports["moeserve"] == {ns.port, ns.grpc_port} == {8000, 50051}
    assert ns.host == "0.0.0.0"


def test_volumes_consistent():
    declared = set(COMPOSE.get("volumes", {}))
    used: set[str] = set()
    for name, svc in SERVICES.items():
        targets = []
        for volume in svc.get("volumes", []):
            source, target, mode = split_volume(volume)
            targets.append(target)
            if source.startswith((".", "/", "$")):
                if source.startswith("$"):  # host path with a default (docker logs dir)
                    assert re.fullmatch(r"\$\{\w+:-/[\w/.-]+\}", source), (name, volume)
                    continue
                path = (DEPLOY / source).resolve()
                assert path.exists(), f"{name}: bind source {source} does not exist"
                assert mode == ["ro"], f"{name}: config mount {volume} should be read-only"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"
                used.add(source)
        assert len(targets) == len(set(targets)), name
    assert used == declared, f"declared but unused volumes: {declared - used}"
    # Every stateful component keeps its data in a named volume.
    for name, path in (
        ("prometheus", "/prometheus"),
        ("loki", "/loki"),
        ("tempo", "/var/tempo"),
        ("grafana", "/var/lib/grafana"),
        ("alertmanager", "/alertmanager"),
    ):
        assert any(
            split_volume(v)[1] == path and not v.startswith(".") for v in SERVICES[name]["volumes"]
        )


def mounted_file(service: str, container_path: str) -> Path:
    """The repository file that `container_path` is in a service's container."""
    for volume in SERVICES[service].get("volumes", []):
        source, target, _ = split_volume(volume)
        if not source.startswith("."):
            continue
        if container_path == target:
            return (DEPLOY / source).resolve()
        if container_path.startswith(target.rstrip("/") + "/"):
            return (DEPLOY / source / container_path[len(target.rstrip("/")) + 1 :]).resolve()
    raise AssertionError(f"{service}: {container_path} is not mounted from the repository")


def config_flag(service: str, flag: str) -> str:
    args = SERVICES[service]["command"]
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, (service, flag, args)
    return values[0]


def test_every_service_has_its_config_file():
    expected = {
        "otel-collector": ("--config", COLLECTOR_YML),
        "tempo": ("-config.file", TEMPO_YML),
        "loki": ("-config.file", LOKI_YML),
        "prometheus": ("--config.file", PROMETHEUS_YML),
        "alertmanager": ("--config.file", DEPLOY / "alertmanager" / "alertmanager.yml"),
    }
    for service, (flag, repo_file) in expected.items():
        path = mounted_file(service, config_flag(service, flag))
        assert path == repo_file.resolve() and path.is_file(), service
    # Prometheus rule files travel with the mounted folder.
    for rule_file in load_yaml(PROMETHEUS_YML)["rule_files"]:
        assert (PROMETHEUS_YML.parent / rule_file).is_file()
    # Grafana's provisioning and dashboards.
    assert (
        mounted_file("grafana", "/etc/grafana/provisioning/datasources/datasources.yml")
        == DATASOURCES_YML
    )


def test_healthchecks():
    for name, svc in SERVICES.items():
        if name in NO_HEALTHCHECK:
            assert "healthcheck" not in svc, name
            continue
        check = svc["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries"} <= set(check), name
        urls = re.findall(r"http://[\w.:/-]+", " ".join(check["test"]))
        assert len(urls) == 1, name
        host, port = host_port(urls[0])
        assert host in ("127.0.0.1", "localhost") and port in listen_port(name), (name, urls[0])
    # The probes hit the routes the service really serves.
    assert SERVICES["moeserve"]["healthcheck"]["test"][-1].count("/ready") == 1
    assert "/health" in " ".join(SERVICES["anomaly-webhook"]["healthcheck"]["test"])


def test_depends_on_conditions():
    for name, svc in SERVICES.items():
        for dep, spec in svc.get("depends_on", {}).items():
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], (name, dep)
            elif condition == "service_completed_successfully":
                assert SERVICES[dep].get("restart") == "no", (name, dep)
            else:
                assert condition == "service_started", (name, dep)


def test_moeserve_service():
    svc = SERVICES["moeserve"]
    env = svc["environment"]
    ns = serve_parser().parse_args(svc["command"])
    assert ns.command == "serve"
    # Traces go to the Collector's OTLP/gRPC receiver.
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert_reaches(env["OTEL_EXPORTER_OTLP_ENDPOINT"], "moeserve OTLP endpoint")
    assert port_of(env["OTEL_EXPORTER_OTLP_ENDPOINT"]) == port_of(
        COLLECTOR["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    )
    assert env["MOESERVE_LOG_FORMAT"] == "json"
    # SIGTERM drain fits in the stop grace period.
    grace = int(svc["stop_grace_period"].rstrip("s"))
    assert grace >= float(env["MOESERVE_DRAIN_TIMEOUT"]) + 5
    # The webhook runs from the same image.
    hook = SERVICES["anomaly-webhook"]
    assert hook["image"] == svc["image"]
    args = serve_parser().parse_args(hook["command"])
    assert args.command == "anomaly-webhook"
    assert_reaches(args.prometheus_url, "anomaly webhook Prometheus URL")


def test_prometheus_in_compose():
    cmd = SERVICES["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in cmd
    cfg = load_yaml(PROMETHEUS_YML)
    for job in cfg["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = host_port(target)
                if host == "localhost":
                    assert job["job_name"] == "prometheus" and port in listen_port("prometheus")
                else:
                    assert_reaches(target, f"scrape job {job['job_name']}")
    scraped = {
        host_port(t)[0]
        for j in cfg["scrape_configs"]
        for s in j["static_configs"]
        for t in s["targets"]
    }
    assert {"moeserve", "anomaly-webhook", "otel-collector"} <= scraped
    for am in cfg["alerting"]["alertmanagers"]:
        for static in am["static_configs"]:
            for target in static["targets"]:
                assert_reaches(target, "Prometheus -> Alertmanager")


def test_alertmanager_routes_to_the_webhook_service():
    am = load_yaml(DEPLOY / "alertmanager" / "alertmanager.yml")
    for receiver in am["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            assert_reaches(hook["url"], "Alertmanager webhook")
            assert urlsplit(hook["url"]).path == "/alerts"


def test_grafana_datasources_reach_their_services():
    for ds in load_yaml(DATASOURCES_YML)["datasources"]:
        assert_reaches(ds["url"], f"Grafana datasource {ds['name']}")


def test_logging_options_feed_the_collector():
    """The services whose logs the Collector keeps label their lines with the compose
    service name; the Collector's router selects exactly those."""
    router = next(
        op for op in COLLECTOR["receivers"]["filelog/docker"]["operators"] if op["type"] == "router"
    )
    expr = router["routes"][0]["expr"]
    selected = set(json.loads(re.search(r"in (\[.*\])", expr).group(1)))
    labelled = {
        n
        for n, s in SERVICES.items()
        if "com.docker.compose.service" in s.get("logging", {}).get("options", {}).get("labels", "")
    }
    assert selected == labelled == {"moeserve", "anomaly-webhook"}
    for name in labelled:
        assert SERVICES[name]["logging"]["driver"] == "json-file"
    # The model name reaches the log records (the dashboards' logs panel filters on it).
    assert "MOESERVE_SERVED_MODEL_NAME" in SERVICES["moeserve"]["logging"]["options"]["env"]
    assert "MOESERVE_SERVED_MODEL_NAME" in SERVICES["moeserve"]["environment"]
    mounts = [v for v in SERVICES["otel-collector"]["volumes"] if "/var/lib/docker/containers" in v]
    assert mounts and mounts[0].endswith(":/var/lib/docker/containers:ro")
    include = COLLECTOR["receivers"]["filelog/docker"]["include"]
    assert include == ["/var/lib/docker/containers/*/*-json.log"]


def test_cuda_override():
    override = load_yaml(COMPOSE_CUDA_YML)
    assert set(override["services"]) <= set(SERVICES)
    moe = override["services"]["moeserve"]
    assert (DEPLOY / moe["build"]["context"]).resolve() == ROOT
    assert (ROOT / moe["build"]["dockerfile"]).is_file()
    assert moe["environment"]["MOESERVE_DEVICE"] == "cuda"
    (device,) = moe["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


# --------------------------------------------------------------------------- OTel Collector

# Component types of the contrib distribution this config may use (documented in the
# collector's and collector-contrib's READMEs).
COLLECTOR_COMPONENTS = {
    "receivers": {"otlp", "filelog", "prometheus", "hostmetrics", "docker_stats"},
    "processors": {
        "batch",
        "memory_limiter",
        "resource",
        "attributes",
        "transform",
        "filter",
        "resourcedetection",
        "k8sattributes",
    },
    "exporters": {"otlp", "otlphttp", "debug", "prometheus", "prometheusremotewrite", "file"},
    "extensions": {"health_check", "file_storage", "pprof", "zpages"},
    "connectors": {"spanmetrics", "servicegraph", "forward"},
}
PIPELINE_TYPES = {"traces", "metrics", "logs", "profiles"}
# stanza operators (pkg/stanza/docs/operators) and the keys each accepts.
OPERATOR_KEYS = {
    "container": {
        "format",
        "add_metadata_from_filepath",
        "max_log_size",
        "parse_from",
        "parse_to",
        "on_error",
        "if",
        "severity",
    },
    "router": {"routes", "default"},
    "json_parser": {
        "parse_from",
        "parse_to",
        "on_error",
        "if",
        "timestamp",
        "severity",
        "body",
        "scope_name",
        "parse_ints",
    },
    "regex_parser": {"regex", "parse_from", "parse_to", "on_error", "if", "timestamp", "severity"},
    "trace_parser": {"trace_id", "span_id", "trace_flags", "on_error", "if"},
    "severity_parser": {"parse_from", "mapping", "preset", "on_error", "if", "overwrite_text"},
    "time_parser": {"parse_from", "layout", "layout_type", "location", "on_error", "if"},
    "copy": {"from", "to", "on_error", "if"},
    "move": {"from", "to", "on_error", "if"},
    "remove": {"field", "on_error", "if"},
    "add": {"field", "value", "on_error", "if"},
    "retain": {"fields", "on_error", "if"},
    "filter": {"expr", "drop_ratio", "on_error", "if"},
    "recombine": {
        "combine_field",
        "is_first_entry",
        "is_last_entry",
        "combine_with",
        "source_identifier",
        "max_log_size",
        "max_batch_size",
        "max_sources",
        "force_flush_period",
        "max_unmatched_batch_size",
        "on_error",
        "if",
    },
}
FIELD = re.compile(r'^(body|attributes|resource)((\.\w+)|(\["[^"]+"\]))*$')


def component_type(name: str) -> str:
    return name.split("/", 1)[0]


def test_collector_top_level_and_components():
    assert set(COLLECTOR) <= {
        "receivers",
        "processors",
        "exporters",
        "extensions",
        "connectors",
        "service",
    }
    for kind, allowed in COLLECTOR_COMPONENTS.items():
        for name in COLLECTOR.get(kind, {}) or {}:
            assert component_type(name) in allowed, f"unknown {kind[:-1]} type: {name}"
    assert set(COLLECTOR["service"]) <= {"extensions", "pipelines", "telemetry"}


def test_collector_pipelines_reference_defined_components():
    service = COLLECTOR["service"]
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in service["pipelines"].items():
        assert component_type(name) in PIPELINE_TYPES, name
        assert set(pipeline) <= {"receivers", "processors", "exporters"}
        assert pipeline.get("receivers") and pipeline.get("exporters"), name
        for kind, names in used.items():
            for component in pipeline.get(kind, []):
                assert component in COLLECTOR[kind], f"pipeline {name}: {component} not defined"
                names.add(component)
        processors = pipeline.get("processors", [])
        if "memory_limiter" in processors:
            assert processors[0] == "memory_limiter", "memory_limiter must run first"
        if "batch" in processors:
            assert processors[-1] == "batch", "batch belongs at the end"
    for kind, names in used.items():
        assert names == set(COLLECTOR[kind]), (
            f"{kind} defined but unused: {set(COLLECTOR[kind]) - names}"
        )
    for ext in service["extensions"]:
        assert ext in COLLECTOR["extensions"]
    assert set(service["extensions"]) == set(COLLECTOR["extensions"])
    storage = COLLECTOR["receivers"]["filelog/docker"]["storage"]
    assert storage in service["extensions"] and component_type(storage) == "file_storage"


def test_collector_routes_traces_to_tempo_and_logs_to_loki():
    pipelines = COLLECTOR["service"]["pipelines"]
    (tempo,) = pipelines["traces"]["exporters"]
    assert component_type(tempo) == "otlp"
    endpoint = COLLECTOR["exporters"][tempo]["endpoint"]
    assert_reaches(endpoint, "Collector -> Tempo")
    assert port_of(endpoint) == port_of(
        TEMPO["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    )
    assert "filelog/docker" in pipelines["logs"]["receivers"]
    (loki,) = pipelines["logs"]["exporters"]
    assert component_type(loki) == "otlphttp"
    endpoint = COLLECTOR["exporters"][loki]["endpoint"]
    assert_reaches(endpoint, "Collector -> Loki")
    assert urlsplit(endpoint).path == "/otlp"  # Loki's native OTLP ingestion
    # The Collector's storage directory is a volume.
    directory = COLLECTOR["extensions"]["file_storage/filelog"]["directory"]
    assert any(
        directory.startswith(split_volume(v)[1])
        for v in SERVICES["otel-collector"]["volumes"]
        if not v.startswith((".", "$"))
    )


def test_collector_filelog_operators():
    operators = COLLECTOR["receivers"]["filelog/docker"]["operators"]
    ids = [op.get("id", op["type"]) for op in operators]
    assert len(ids) == len(set(ids)), "operator ids must be unique"
    for op in operators:
        assert op["type"] in OPERATOR_KEYS, op["type"]
        extra = set(op) - OPERATOR_KEYS[op["type"]] - {"type", "id", "output"}
        assert not extra, (op["type"], extra)
        outputs = op.get("output", [])
        for out in [outputs] if isinstance(outputs, str) else outputs:
            assert out in ids, (op["type"], out)
        for route in op.get("routes", []):
            assert route["output"] in ids and route["expr"]
        for key in ("parse_from", "parse_to", "from", "to", "field"):
            if key in op:
                assert FIELD.match(op[key]), (op["type"], key, op[key])
        for key in ("trace_id", "span_id", "timestamp", "severity"):
            if key in op:
                assert FIELD.match(op[key]["parse_from"]), (op["type"], key)
    types = [op["type"] for op in operators]
    assert types[0] == "container" and "json_parser" in types and "trace_parser" in types


def test_collector_parses_the_fields_of_real_log_lines():
    """The fields the operators read exist, with the expected formats, in a JSON line
    written by telemetry.logging inside a span."""
    line = real_log_line()
    record = json.loads(line)
    operators = {
        op.get("id", op["type"]): op for op in COLLECTOR["receivers"]["filelog/docker"]["operators"]
    }
    parse = operators["parse_json"]
    prefix = parse["parse_to"] + "."

    def key(field: str) -> str:
        assert field.startswith(prefix), field
        return field[len(prefix) :]

    trace = operators["trace_context"]
    assert re.fullmatch(r"[0-9a-f]{32}", record[key(trace["trace_id"]["parse_from"])])
    assert re.fullmatch(r"[0-9a-f]{16}", record[key(trace["span_id"]["parse_from"])])
    assert record[key(operators["request_id"]["from"])] == "req-1"
    assert record[key(operators["logger"]["from"])] == "service.test"
    level = record[key(parse["severity"]["parse_from"])]
    assert level == "info"
    stamp = record[key(parse["timestamp"]["parse_from"])]
    # gotime layout 2006-01-02T15:04:05.999999999Z07:00 = RFC 3339 with optional fraction.
    assert parse["timestamp"]["layout_type"] == "gotime"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)", stamp), (
        stamp
    )
    assert re.match(r"^\s*\{", line)  # the json_parser's `if`


# --------------------------------------------------------------------------- Tempo and Loki

# Top-level blocks of the Tempo configuration reference (docs/sources/tempo/configuration).
TEMPO_TOP = {
    "target",
    "http_api_prefix",
    "server",
    "distributor",
    "ingester",
    "metrics_generator",
    "query_frontend",
    "querier",
    "compactor",
    "storage",
    "memberlist",
    "overrides",
    "usage_report",
    "cache",
    "stream_over_http_enabled",
    "multitenancy_enabled",
    "backend_scheduler",
    "backend_worker",
    "ingest",
}
# Top-level blocks of the Loki configuration reference (docs/sources/shared/configuration.md).
LOKI_TOP = {
    "target",
    "auth_enabled",
    "server",
    "common",
    "schema_config",
    "storage_config",
    "limits_config",
    "compactor",
    "ingester",
    "querier",
    "query_range",
    "frontend",
    "frontend_worker",
    "query_scheduler",
    "ruler",
    "distributor",
    "memberlist",
    "pattern_ingester",
    "analytics",
    "table_manager",
    "runtime_config",
    "tracing",
    "bloom_build",
    "bloom_gateway",
    "index_gateway",
    "chunk_store_config",
    "ingester_client",
    "operational_config",
    "tenant_limits",
}


def volume_paths(service: str) -> list[str]:
    return [
        split_volume(v)[1] for v in SERVICES[service]["volumes"] if not v.startswith((".", "$"))
    ]


def test_tempo_config():
    assert set(TEMPO) <= TEMPO_TOP, set(TEMPO) - TEMPO_TOP
    otlp = TEMPO["distributor"]["receivers"]["otlp"]["protocols"]
    assert set(otlp) <= {"grpc", "http"}
    for proto in otlp.values():
        assert proto["endpoint"].startswith("0.0.0.0:")
    trace = TEMPO["storage"]["trace"]
    assert trace["backend"] == "local"
    data = volume_paths("tempo")
    for path in (trace["wal"]["path"], trace["local"]["path"]):
        assert any(path.startswith(d + "/") for d in data), path
    assert TEMPO["server"]["http_listen_port"] == 3200


def test_loki_config():
    assert set(LOKI) <= LOKI_TOP, set(LOKI) - LOKI_TOP
    assert LOKI["auth_enabled"] is False  # single tenant: the Collector sends no X-Scope-OrgID
    (schema,) = LOKI["schema_config"]["configs"]
    # OTLP ingestion needs structured metadata: tsdb index, schema v13.
    assert schema["store"] == "tsdb" and schema["schema"] == "v13"
    assert LOKI["limits_config"]["allow_structured_metadata"] is True
    data = volume_paths("loki")
    assert any(
        LOKI["common"]["path_prefix"] == d or LOKI["common"]["path_prefix"].startswith(d + "/")
        for d in data
    )
    fs = LOKI["common"]["storage"]["filesystem"]
    for path in fs.values():
        assert path.startswith(LOKI["common"]["path_prefix"] + "/")
    assert_reaches(LOKI["ruler"]["alertmanager_url"], "Loki ruler -> Alertmanager")


def test_yaml_files_are_plain_yaml():
    """The configs parse with a strict YAML loader (no duplicate keys hiding a setting)."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        assert not dupes, f"duplicate keys {dupes} at line {node.start_mark.line + 1}"
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    for path in (
        COMPOSE_YML,
        COMPOSE_CUDA_YML,
        COLLECTOR_YML,
        TEMPO_YML,
        LOKI_YML,
        PROMETHEUS_YML,
        DATASOURCES_YML,
    ):
        yaml.load(path.read_text(), Loader=Strict)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
