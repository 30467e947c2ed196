"""The inspector page in a real browser: headless Debian chromium driven by Playwright (never
`playwright install`: .ci/run installs the chromium package) against `moeserve serve` on a
free 127.0.0.1 port, after five requests: one completed over REST, one over gRPC, one
rejected with 429, one aborted by a client disconnect, one failing with 400.

The 429 is made deterministic with one sequence slot and one waiting place: a long stream
takes the slot and the engine core is paused (SIGSTOP), the REST request waits behind it,
the next one is refused; then the stream's client hangs up (the abort), the core resumes and
the waiting request completes. A screenshot of the page
with the completed request opened is saved under the test's tmp dir (and under
$MOESERVE_ARTIFACTS_DIR when set); its path is printed.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import grpc
import httpx
import pytest

from bench.harness import ServerProcess, iter_sse, wait_until
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from tests.inspector.helpers import engine_paused

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
COMPLETIONS = "/v1/completions"
# request id -> (outcome, what the status cell says)
EXPECTED = {
    "browser-rest": ("ok", "200"),
    "browser-grpc": ("ok", "OK"),
    "browser-429": ("rejected", "429 rejected"),
    "browser-abort": ("aborted", "499 aborted"),
    "browser-400": ("error", "400 error"),
}


def _post(url: str, request_id: str, **body) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.post(COMPLETIONS, json=body, headers={"x-request-id": request_id})


def _five_requests(server: ServerProcess) -> None:
    url = server.url
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"prompt": "count", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        request = http.build_request(
            "POST", COMPLETIONS, json=body, headers={"x-request-id": "browser-abort"}
        )
        holder = http.send(request, stream=True)  # takes the one sequence slot
        assert holder.status_code == 200
        next(iter_sse(holder.iter_lines()))
        done: dict[str, httpx.Response] = {}
        waiting = threading.Thread(
            target=lambda: done.setdefault(
                # all four tokens (the page shows four steps): sampled at temperature 1, the
                # tiny model's EOS can end it a step early (seen once in a full test run)
                "rest",
                _post(url, "browser-rest", prompt="hello inspector", max_tokens=4, ignore_eos=True),
            )
        )
        with engine_paused(server.engine_core_pid()):  # the slot stays taken meanwhile
            waiting.start()
            wait_until(
                lambda: http.get("/ready").json()["num_waiting"] == 1, 60, "a waiting request"
            )
            rejected = _post(url, "browser-429", prompt="one too many", max_tokens=2)
            assert rejected.status_code == 429, rejected.text
            holder.close()  # the client hangs up mid-stream: the abort
        waiting.join(120)
        assert done["rest"].status_code == 200, done["rest"].text
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(
                prompt="hello over gRPC",
                params=pb.SamplingParams(max_tokens=3),
                request_id="browser-grpc",
            ),
            timeout=60,
        )
        assert reply.usage.completion_tokens == 3
    assert _post(url, "browser-400", prompt="hi", max_tokens=0).status_code == 400


def _all_recorded(url: str) -> bool:
    rows = httpx.get(url + "/inspect/api/requests", timeout=10).json()["requests"]
    outcomes = {r["request_id"]: r["outcome"] for r in rows}
    return all(outcomes.get(rid) == outcome for rid, (outcome, _) in EXPECTED.items())


def _save_screenshot(page, tmp_path: Path) -> Path:
    path = tmp_path / "inspector.png"
    page.screenshot(path=str(path), full_page=True)
    artifacts = os.environ.get("MOESERVE_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / "inspector.png")
        print(f"inspector screenshot: {Path(artifacts) / 'inspector.png'}")
    print(f"inspector screenshot: {path}")
    return path


@pytest.mark.slow
def test_the_page_shows_each_request_and_what_happened_to_it(tiny_model_dir, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed (apt-get install chromium); browser test not run")
    with ServerProcess(
        tiny_model_dir,
        "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "1", "--max-waiting", "1",
        "--max-model-len", "2048", "--kv-cache-tokens", "8192", "--inspector-requests", "50",
        grpc=True,
        start_timeout=180,
    ) as server:  # fmt: skip
        _five_requests(server)
        wait_until(lambda: _all_recorded(server.url), 30, "all five requests recorded")
        console_errors: list[str] = []
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on(
                    "console",
                    lambda m: console_errors.append(m.text) if m.type == "error" else None,
                )
                page.on("pageerror", lambda exc: console_errors.append(str(exc)))
                page.goto(server.url + "/inspect")
                rows = page.locator("#request-table tbody tr")
                sync_api.expect(rows).to_have_count(len(EXPECTED), timeout=30_000)
                for request_id, (outcome, status) in EXPECTED.items():
                    row = page.locator(f'tr[data-request-id="{request_id}"]')
                    assert row.get_attribute("data-outcome") == outcome, request_id
                    assert row.locator("td.status").inner_text().strip() == status, request_id
                assert (
                    page.locator('tr[data-request-id="browser-grpc"] td').nth(1).inner_text()
                    == "gRPC"
                )

                page.locator("#filters button[data-filter=rejected]").click()
                sync_api.expect(rows).to_have_count(1)
                assert rows.first.get_attribute("data-request-id") == "browser-429"
                page.locator("#filters button[data-filter=all]").click()
                sync_api.expect(rows).to_have_count(len(EXPECTED))

                page.locator('tr[data-request-id="browser-rest"]').click()
                detail = page.locator("#detail")
                sync_api.expect(detail).to_be_visible()
                for phase in ("queue", "prefill", "decode"):
                    assert page.locator(f'#timeline rect.phase[data-phase="{phase}"]').count() == 1
                assert page.locator("#timeline line.first-token").count() == 1
                steps = page.locator("#step-table tbody tr")
                sync_api.expect(steps).to_have_count(
                    4
                )  # the prefill step and 3 decode steps (rendered async)
                assert page.locator("#timeline rect.step").count() == 4
                logs = page.locator("#logs .log-line")
                sync_api.expect(logs.filter(has_text='"request finished"')).to_have_count(1)
                assert "browser-rest" in logs.first.inner_text()
                assert "null" not in page.locator("#detail-facts").inner_text()

                heatmap = page.locator("#heatmap")  # tiny model: 2 MoE layers x 4 experts
                assert heatmap.get_attribute("data-layers") == "2"
                assert heatmap.get_attribute("data-experts") == "4"
                layers = page.locator("#expert-layers tbody tr")
                sync_api.expect(layers).to_have_count(2)
                loads = [int(layers.nth(i).locator("td").nth(1).inner_text()) for i in range(2)]
                assert loads[0] > 0 and loads[0] == loads[1]  # every token visits both layers
                _save_screenshot(page, tmp_path)

                page.locator('tr[data-request-id="browser-abort"]').click()
                sync_api.expect(page.locator("#detail-title")).to_contain_text("browser-abort")
                engine_line = logs.filter(has_text='"request aborted"')
                sync_api.expect(engine_line).to_have_count(1)  # shipped by the engine core
                assert '"logger":"inference.engine"' in engine_line.inner_text()
            finally:
                browser.close()
        assert console_errors == []
