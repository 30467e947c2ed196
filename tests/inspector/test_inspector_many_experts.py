"""A DeepSeek-V3-shaped expert layout end to end: a demo checkpoint of 58 MoE layers that
route 8 of 256 experts (tiny hidden size) served by `moeserve serve`. The metrics stay
bounded (ranges of 8 experts, exact per-layer gauges) and agree with the inspector's
every-expert counts; the inspector page draws the 58 x 256 grid and its per-layer lines in
headless chromium, names a hovered cell, and opens a request served by that model."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import ServerProcess, wait_until
from inference.checkpoints.demo_model import Preset, write_demo_model
from tests.inspector.test_inspector_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.slow

LAYERS, EXPERTS, TOP_K = 58, 256, 8
MANY_EXPERTS = Preset(
    num_layers=LAYERS, hidden=32, num_heads=2, head_dim=16, num_kv_heads=1,
    num_experts=EXPERTS, top_k=TOP_K, ffn=8, vocab_size=1024, max_positions=512,
    rope_theta=1e4, dtype=torch.float32,
)  # fmt: skip


@pytest.fixture(scope="module")
def many_experts_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("many-experts"), MANY_EXPERTS, seed=0)


def _metric_samples(url: str) -> dict[str, list]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _check_metrics_against_the_inspector(url: str) -> dict:
    engine = httpx.get(url + "/inspect/api/engine", timeout=10).json()
    experts = engine["experts"]
    assert experts["num_experts"] == EXPERTS and len(experts["tokens"]) == LAYERS
    samples = _metric_samples(url)
    tokens = [s for s in samples["moeserve_moe_expert_tokens"] if s.name.endswith("_total")]
    assert len(tokens) == LAYERS * EXPERTS // 8  # ranges of 8 experts: 1,856, not 14,848
    (size,) = samples["moeserve_moe_expert_bucket_size"]
    assert size.value == 8
    moe = sum(len(v) for k, v in samples.items() if k.startswith("moeserve_moe_"))
    assert moe <= 2048 + LAYERS * 8 + 1
    # everything ran in the last minute: the counters since start-up equal the inspector's
    # window, range by range
    grid = experts["tokens"]
    for s in tokens:
        lo, hi = (int(x) for x in s.labels["expert"].split("-"))
        assert s.value == sum(grid[int(s.labels["layer"])][lo : hi + 1]), s.labels
    hot = {
        s.labels["layer"]: int(s.value)
        for s in samples["moeserve_moe_hot_expert"]
        if s.labels["rank"] == "1"
    }
    assert len(hot) == LAYERS and all(0 <= e < EXPERTS for e in hot.values())
    imbalance = [s.value for s in samples["moeserve_moe_expert_imbalance"]]
    assert len(imbalance) == LAYERS and all(v >= 1 for v in imbalance)
    return experts


def test_a_256_expert_model_in_the_metrics_and_the_inspector(many_experts_dir, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with ServerProcess(
        many_experts_dir, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-tokens", "4096", start_timeout=300,
    ) as server:  # fmt: skip
        url = server.url
        for i in range(3):
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": f"route me {i}", "max_tokens": 6, "ignore_eos": True},
                headers={"x-request-id": f"many-{i}"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        wait_until(
            lambda: (
                len(httpx.get(url + "/inspect/api/requests", timeout=10).json()["requests"]) == 3
            ),
            30,
            "three requests recorded",
        )
        experts = _check_metrics_against_the_inspector(url)
        if not Path(CHROMIUM).exists():
            pytest.skip("chromium not installed (apt-get install chromium); page not checked")
        errors: list[str] = []
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(url + "/inspect")
                layers = page.locator("#expert-layers tbody tr")
                sync_api.expect(layers).to_have_count(LAYERS, timeout=30_000)
                heatmap = page.locator("#heatmap")
                assert heatmap.get_attribute("data-layers") == str(LAYERS)
                assert heatmap.get_attribute("data-experts") == str(EXPERTS)
                box = heatmap.bounding_box()
                assert box["width"] <= 1000 and box["height"] <= 480  # the grid fits the page
                # a line per layer: its busiest experts (at most 8), busiest first
                row = layers.nth(5)
                assert row.get_attribute("data-layer") == "5"
                shown = row.locator(".hot-expert")
                assert 1 <= shown.count() <= 8
                counts = [
                    int(shown.nth(i).get_attribute("data-tokens")) for i in range(shown.count())
                ]
                assert counts == sorted(counts, reverse=True)
                assert max(experts["tokens"][5]) == counts[0]
                # hovering a cell names it: layer 5, expert 200 (cells are data-sized)
                cw = (box["width"] - 34 - 4) / EXPERTS
                ch = (box["height"] - 14 - 4) / LAYERS
                page.mouse.move(box["x"] + 34 + cw * 200.5, box["y"] + 14 + ch * 5.5)
                readout = page.locator("#heatmap-readout")
                sync_api.expect(readout).to_contain_text("layer 5, expert 200:")
                # a layer's line outlines it in the grid and stays selected across refreshes
                row.click()
                selected = page.locator('#expert-layers tr[data-layer="5"]')
                sync_api.expect(selected).to_have_class(re.compile(r"\bselected\b"))
                # 3 short requests leave ~1 token per expert: max/mean is not flagged
                assert "sparse" in selected.get_attribute("class")
                # a request served by this model opens as usual
                page.locator('tr[data-request-id="many-1"]').click()
                sync_api.expect(page.locator("#detail")).to_be_visible()
                sync_api.expect(page.locator("#step-table tbody tr")).to_have_count(6)
                shot = tmp_path / "inspector-256-experts.png"
                page.screenshot(path=str(shot), full_page=True)
                artifacts = os.environ.get("MOESERVE_ARTIFACTS_DIR")
                if artifacts:
                    Path(artifacts).mkdir(parents=True, exist_ok=True)
                    (Path(artifacts) / shot.name).write_bytes(shot.read_bytes())
                print(f"inspector screenshot: {shot}")
            finally:
                browser.close()
        assert errors == []
