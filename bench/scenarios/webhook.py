"""The anomaly webhook of a scenario run: `telemetry.anomaly.run` (what `moeserve
anomaly-webhook` serves) with the analysis window, step and rate window of the run's
compressed time, which the CLI does not expose.

    python -m bench.scenarios.webhook --port 9095 --prometheus-url http://127.0.0.1:9090 \\
        --window-s 150 --step-s 1 --rate-window 10s --onset-lookback-s 12
"""

from __future__ import annotations

import argparse

from telemetry.anomaly import run
from telemetry.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.webhook")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prometheus-url", required=True)
    p.add_argument("--window-s", type=float, required=True)
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--rate-window", required=True)
    p.add_argument("--onset-lookback-s", type=float, required=True)
    ns = p.parse_args(argv)
    configure_logging("json")
    run(
        host="127.0.0.1",
        port=ns.port,
        prometheus_url=ns.prometheus_url,
        window_s=ns.window_s,
        step_s=ns.step_s,
        rate_window=ns.rate_window,
        onset_lookback_s=ns.onset_lookback_s,
        query_timeout_s=10.0,
    )


if __name__ == "__main__":
    main()
