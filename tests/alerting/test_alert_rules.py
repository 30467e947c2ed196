"""Prometheus rules and Alertmanager configuration under deploy/.

promtool / amtool come from the Debian packages `prometheus` and
`prometheus-alertmanager`; the tests that need them skip, saying so, when absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.rules.yml"))
ALERT_RULES = PROM_DIR / "rules" / "moeserve-alerts.rules.yml"
UNIT_TESTS = PROM_DIR / "tests" / "moeserve-alerts.test.yml"
RUNBOOKS = PROM_DIR / "runbooks.md"
PROMETHEUS_YML = PROM_DIR / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install {package}); check not run")
    return path


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(a) for a in args], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERT_RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_rule_files_exist():
    assert ALERT_RULES in RULE_FILES and len(RULE_FILES) >= 2
    assert UNIT_TESTS.is_file() and PROMETHEUS_YML.is_file() and ALERTMANAGER_YML.is_file()


def test_promtool_check_rules():
    promtool = tool("promtool", "prometheus")
    out = run(promtool, "check", "rules", *RULE_FILES).stdout
    assert "SUCCESS" in out


def test_promtool_unit_tests():
    promtool = tool("promtool", "prometheus")
    out = run(promtool, "test", "rules", UNIT_TESTS)
    assert "SUCCESS" in out.stdout + out.stderr


def test_promtool_check_config():
    promtool = tool("promtool", "prometheus")
    out = run(promtool, "check", "config", PROMETHEUS_YML).stdout
    assert "SUCCESS" in out


def test_amtool_check_config():
    amtool = tool("amtool", "prometheus-alertmanager")
    out = run(amtool, "check-config", ALERTMANAGER_YML).stdout
    assert "SUCCESS" in out


def test_every_alert_routes_to_the_anomaly_webhook():
    amtool = tool("amtool", "prometheus-alertmanager")
    for rule in alert_rules():
        labels = [f"alertname={rule['alert']}"] + [f"{k}={v}" for k, v in rule["labels"].items()]
        out = run(
            amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}", *labels
        ).stdout
        assert out.strip() == "anomaly-webhook", (rule["alert"], out)


def test_every_alert_is_documented():
    anchors = {
        re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
        for h in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.MULTILINE)
    }
    required = {
        "MoeserveTTFTSLOBurnRate",
        "MoeserveTPOTSLOBurnRate",
        "MoeserveHighErrorRatio",
        "MoeserveWaitingQueueSaturated",
        "MoeserveKVCacheNearFull",
        "MoeservePreemptionStorm",
        "MoeserveExpertLoadImbalance",
        "MoeserveTargetDown",
        "ScrapeTargetDown",
        "MoeserveReplicaDown",
        "MoeserveReplicaStarved",
    }
    assert required <= {r["alert"] for r in alert_rules()}
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        ann = rule["annotations"]
        assert ann.get("summary") and ann.get("description"), rule["alert"]
        runbook = ann.get("runbook_url", "")
        assert runbook.startswith("deploy/prometheus/runbooks.md#"), rule["alert"]
        assert runbook.split("#", 1)[1] in anchors, (rule["alert"], runbook)


def test_every_alert_has_firing_and_not_firing_unit_tests():
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    firing, quiet = set(), set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - firing == set(), "alerts without a firing test"
    assert names - quiet == set(), "alerts without a not-firing test"


def test_alertmanager_inhibitions_name_real_alerts():
    am = yaml.safe_load(ALERTMANAGER_YML.read_text())
    names = {r["alert"] for r in alert_rules()}
    assert am["route"]["receiver"] == "anomaly-webhook"
    urls = [w["url"] for r in am["receivers"] for w in r.get("webhook_configs", [])]
    assert urls == ["http://anomaly-webhook:9095/alerts"]
    inhibits = am["inhibit_rules"]
    down = next(r for r in inhibits if 'alertname="MoeserveTargetDown"' in r["source_matchers"])
    assert set(down["equal"]) >= {"instance"}
    pattern = down["target_matchers"][0].split("=~", 1)[1].strip('"')
    targets = set(pattern.split("|"))
    assert targets <= names and "MoeserveTTFTSLOBurnRate" in targets
    sev = next(r for r in inhibits if r["source_matchers"] == ['severity="critical"'])
    assert {"alertname", "model", "instance"} <= set(sev["equal"])


def test_prometheus_config_targets():
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["moeserve"]["static_configs"][0]["targets"] == ["moeserve:8000"]
    assert jobs["anomaly-webhook"]["static_configs"][0]["targets"] == ["anomaly-webhook:9095"]
    am = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"]
    for rule_file in cfg["rule_files"]:
        assert (PROM_DIR / rule_file).is_file()
