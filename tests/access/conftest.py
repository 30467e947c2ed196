"""Fixtures for the access-control tests: certificates made for the run, API-key files, and
settings for servers on free 127.0.0.1 ports (in this process: bench.harness.InProcessServer;
those that need signals: bench.harness.ServerProcess)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.settings import Settings
from tests.access.pki import Pki, make_pki

MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write_keys(path: Path, *entries: dict) -> Path:
    path.write_text(json.dumps({"keys": list(entries)}))
    return path


def settings(model_dir: Path, **overrides) -> Settings:
    base = {
        "model": str(model_dir),
        "port": 0,
        "grpc_port": -1,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_tokens": 8192,
        "max_num_seqs": 8,
        "drain_timeout": 10.0,
        "device": "cpu",
        "dtype": "float32",
    }
    return Settings(**{**base, **overrides})
