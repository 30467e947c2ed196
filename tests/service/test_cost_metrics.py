"""--cost-per-hour on a real server: the gauges equal price / 3600 / the measured tokens per
second (per million), and a bad price stops the start naming the flag."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from inference import InvalidParameterError
from service.cli import build_parser
from service.server import MoeServer
from tests.service.conftest import make_settings

PRICE = 2.5  # USD per hour
APIS = ("rest", "grpc")
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _counter(srv, name: str) -> float:
    registry, model = srv.state.observability.metrics.registry, srv.state.model_name
    return sum(registry.get_sample_value(name, {"model": model, "api": a}) or 0 for a in APIS)


def test_cost_gauge_is_price_over_measured_throughput(start_server, wait_idle):
    with start_server(cost_per_hour=PRICE) as srv, httpx.Client(base_url=srv.url) as http:
        cost = srv.state.observability.cost
        i = 0
        while time.monotonic() - cost.began < 2.0:  # a few seconds of load
            prompt = f"{WORDS[i % len(WORDS)]} {i}"  # short and distinct: no prefix-cache hit
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body, timeout=30).status_code == 200
            i += 1
        wait_idle(srv, 10)
        output = _counter(srv, "moeserve_generation_tokens_total")
        total = output + _counter(srv, "moeserve_prompt_tokens_total")
        before = time.monotonic()
        exposition = http.get("/metrics").text
        elapsed = (before + time.monotonic()) / 2 - cost.began
    model = srv.state.model_name
    for kind, tokens in (("output", output), ("total", total)):
        expected = PRICE / 3600 / (tokens / elapsed) * 1e6
        for line in (
            f'moeserve_cost_per_million_tokens{{kind="{kind}",model="{model}"}}',
            f'llm_cost_per_million_tokens{{cost_basis="{kind}",model_name="{model}"}}',
        ):
            value = next(
                float(row.rsplit(" ", 1)[1])
                for row in exposition.splitlines()
                if row.startswith(line)
            )
            assert value == pytest.approx(expected, rel=0.01), (line, value, expected)


def test_a_negative_price_stops_the_start_naming_the_flag(tiny_model_dir):
    server = MoeServer(make_settings(tiny_model_dir, cost_per_hour=-1.0))
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(server.start())
    assert info.value.param == "cost_per_hour" and "--cost-per-hour" in info.value.message
    assert server.state is None  # refused before the model loaded


@pytest.mark.parametrize("value", ["-0.5", "abc", "nan"])
def test_the_cli_refuses_a_bad_price_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--cost-per-hour", value])
    assert info.value.code == 2
    assert "--cost-per-hour" in capsys.readouterr().err
