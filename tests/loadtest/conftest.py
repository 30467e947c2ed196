"""Fixtures for the load-test tests: the real server (bench/harness.py's ServerProcess, i.e.
`python -m service.cli serve`) as a subprocess on free loopback ports, serving the tiny demo
model behind an API key, and the two load tools (loadtest/locustfile.py,
loadtest/bench_serving.py) driven against it like a user would."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.harness import ServerProcess

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
API_KEY = "sk-loadtest"


@pytest.fixture(scope="session")
def live_server(tiny_model_dir) -> Iterator[ServerProcess]:
    with ServerProcess(
        tiny_model_dir,
        "--served-model-name", "tiny-loadtest", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-tokens", "8192",
        grpc=True,
        api_key=API_KEY,
        start_timeout=120,
        stop_timeout=20,
    ) as server:  # fmt: skip
        httpx.get(server.url + "/ready", timeout=30).raise_for_status()
        yield server


@pytest.fixture(scope="session")
def bench_serving():
    """loadtest/bench_serving.py as a module (it is a script, not a package member; like
    `python loadtest/bench_serving.py`, it finds its sibling prompt_words.py on sys.path)."""
    if str(LOADTEST) not in sys.path:
        sys.path.insert(0, str(LOADTEST))
    spec = importlib.util.spec_from_file_location("bench_serving", LOADTEST / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_serving", module)
    spec.loader.exec_module(module)
    return module
