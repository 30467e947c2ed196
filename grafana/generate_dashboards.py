"""Writes grafana/dashboards/*.json, the dashboards Grafana provisions (grafana/provisioning).

    python grafana/generate_dashboards.py          # rewrite the JSON files
    python grafana/generate_dashboards.py --check  # exit 1 if they are out of date

The JSON files are the product (Grafana loads them as they are); this script only keeps
them consistent: unique panel ids, a gapless 24-column grid, the same template variables,
selectors and drill-down links everywhere. tests/stack checks that the committed files
match its output and runs every Prometheus query in them against a real Prometheus.

The panels are defined in overview_dashboard.py, experts_dashboard.py and
replicas_dashboard.py, from the builders in dashboard_builders.py.

Conventions (tests rely on them):
- Prometheus targets use the `$datasource` variable; Loki and Tempo panels use the
  provisioned uids `loki` and `tempo` (grafana/provisioning/datasources/datasources.yml).
- Every moeserve selector carries model=~"$model" and instance=~"$instance" (vLLM-named
  series model_name=~"$model"; vllm-router's series instance=~"$router").
- Latency panels request exemplars (trace ids) and link to Tempo and Loki in Explore.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Run as a script (grafana/ is no package): its own folder is first on sys.path.
from experts_dashboard import moe_experts
from overview_dashboard import overview
from replicas_dashboard import replicas_dashboard

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"


DASHBOARDS = {
    "moeserve-overview.json": overview,
    "moeserve-moe-experts.json": moe_experts,
    "moeserve-replicas.json": replicas_dashboard,
}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT_DIR / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python grafana/generate_dashboards.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
