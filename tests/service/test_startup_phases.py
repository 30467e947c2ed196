"""A real start's phases: while the engine loads /ready answers 503 with the phase in
progress; once serving it lists every phase reached, in order, and they add up to the start's
measured duration; /metrics has them as moeserve_startup_phase_seconds. One client polls
throughout on kept-alive connections: the switch to serving resets none (it did, about one
start in twenty, while a stand-in listener handed the socket over)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from bench.harness import InProcessServer
from inference.errors import ModelLoadError
from inference.startup import PHASES
from tests.service.conftest import make_settings


def test_phases_sum_to_the_start_and_ready_reports_them_in_order(tiny_model_dir):
    srv = InProcessServer(make_settings(tiny_model_dir, dtype="bfloat16"))
    began = time.monotonic()
    entering = threading.Thread(target=srv.__enter__)
    entering.start()
    seen: list[dict] = []  # the 503 bodies while starting
    try:
        while srv.server.rest_port is None:
            time.sleep(0.002)
        url = f"http://127.0.0.1:{srv.server.rest_port}"
        with httpx.Client(base_url=url, timeout=10) as http:
            while True:
                resp = http.get("/ready")
                if resp.status_code == 200:
                    ready_at = time.monotonic()
                    break
                assert resp.status_code == 503
                body = resp.json()
                if body["status"] == "starting":
                    seen.append(body)
                time.sleep(0.005)
            final = resp.json()
            assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
            exposition = http.get("/metrics").text
    finally:
        entering.join(120)
        srv.__exit__(None, None, None)
    started = ready_at - began
    order = [p["phase"] for p in final["startup"]]
    assert order[0] == "load_weights" and order[-1] == "ready"
    assert set(order) <= set(PHASES) and len(order) == len(set(order))
    assert "kv_cache_alloc" in order and "pack" in order  # bf16 on the CPU: our kernels pack
    total = sum(p["seconds"] for p in final["startup"])
    assert abs(total - started) <= 0.05 * started, (total, started, final["startup"])
    # while starting: the phase in progress, and the ones reached so far in the same order
    assert seen, "never saw /ready while starting"
    for body in seen:
        so_far = [p["phase"] for p in body["startup"]]
        assert so_far == order[: len(so_far)] and body["phase"] == so_far[-1]
    assert seen[0]["phase"] == "load_weights"
    for p in final["startup"]:
        line = (
            f'moeserve_startup_phase_seconds{{model="{srv.state.model_name}",phase="{p["phase"]}"}}'
        )
        assert line in exposition


def _unknown_architecture(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchMoeForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))


def _corrupt_weights(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")


@pytest.mark.parametrize(
    "breaks, message",
    [(_unknown_architecture, "NoSuchMoeForCausalLM"), (_corrupt_weights, "not valid safetensors")],
)
def test_a_start_that_fails_to_load_closes_its_port(tiny_model_dir, tmp_path, breaks, message):
    """The listener is up from the first moment; a load that fails (a model error, named)
    takes it down with it."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    breaks(broken)
    srv = InProcessServer(make_settings(broken))
    with pytest.raises(ModelLoadError, match=message):
        srv.__enter__()
    assert srv.server.rest_port is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{srv.server.rest_port}/ready", timeout=5)
