"""Shared fixtures: tiny random-weight checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> folder of a tiny float32 checkpoint (written on first use)."""
    from inference.checkpoints.demo_model import write_demo_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[str, object] = {}

    def get(arch: str = "mixtral"):
        if arch not in cache:
            cache[arch] = write_demo_model(root / arch, preset="tiny", seed=0, arch=arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(model_dirs):
    return model_dirs("mixtral")
