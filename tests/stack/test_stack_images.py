"""deploy/Dockerfile (CPU) and deploy/Dockerfile.cuda, checked statically (no Docker
here): every COPY source exists and is not excluded from the build context, the image
runs `moeserve serve` with flags `moeserve serve --help` accepts, it serves the demo model
written at build time (nothing downloaded at run time), and base images are pinned."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
from stack_support import DEPLOY, ROOT, serve_parser

DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def build_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for kw, args in instrs:
        if kw == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            out[name] = value
    return out


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_in_the_build_context(dockerfile):
    ignored = dockerignore_patterns()
    copies = [args for kw, args in instructions(dockerfile) if kw == "COPY"]
    assert copies
    local = 0
    for args in copies:
        parts = shlex.split(args)
        if any(p.startswith("--from=") for p in parts):
            continue
        sources = [p for p in parts if not p.startswith("--")][:-1]
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY source {src} is missing"
            for pattern in ignored:
                assert not fnmatch.fnmatch(src.rstrip("/"), pattern.rstrip("/")), (src, pattern)
            local += 1
    assert local >= 4  # pyproject.toml, README.md and the three packages


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_moeserve_serve_with_valid_flags(dockerfile):
    instrs = instructions(dockerfile)
    final_stage = instrs[max(i for i, (kw, _) in enumerate(instrs) if kw == "FROM") :]
    entrypoint = exec_form(next(a for kw, a in reversed(final_stage) if kw == "ENTRYPOINT"))
    cmd = exec_form(next(a for kw, a in reversed(final_stage) if kw == "CMD"))
    assert entrypoint == ["moeserve"]
    ns = serve_parser().parse_args(cmd)  # SystemExit on an unknown flag or bad value
    assert ns.command == "serve"
    assert ns.host == "0.0.0.0" and ns.port == 8000 and ns.grpc_port == 50051
    # The model is the demo checkpoint written at build time: no download at run time.
    (run,) = [a for kw, a in instrs if kw == "RUN" and "moeserve demo-model" in a]
    written = re.search(r"moeserve demo-model (\S+)", run)
    assert ns.model == written.group(1)
    args = build_args(instrs)
    demo_cmd = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], run[written.start() :])
    demo = serve_parser().parse_args(shlex.split(demo_cmd)[1:])
    assert demo.command == "demo-model" and demo.preset in ("tiny", "small")
    env = " ".join(a for kw, a in final_stage if kw == "ENV")
    assert "HF_HUB_OFFLINE=1" in env and "TRANSFORMERS_OFFLINE=1" in env
    # The image's own health check probes the readiness route on the served port.
    health = next(a for kw, a in final_stage if kw == "HEALTHCHECK")
    assert f"http://127.0.0.1:{ns.port}/ready" in health
    assert any(kw == "USER" and a != "root" and a != "0" for kw, a in final_stage)
    exposed = {int(p) for kw, a in final_stage if kw == "EXPOSE" for p in a.split()}
    assert exposed == {ns.port, ns.grpc_port}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_and_torch_are_pinned(dockerfile):
    instrs = instructions(dockerfile)
    args = build_args(instrs)
    bases = [a.split()[0] for kw, a in instrs if kw == "FROM"]
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        if image == "build":
            continue
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    makefile_torch = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert args["TORCH_VERSION"] == makefile_torch
    index = args["TORCH_INDEX_URL"]
    assert index.startswith("https://download.pytorch.org/whl/")
    if dockerfile.name == "Dockerfile":
        assert index.endswith("/cpu") and args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    else:
        assert re.search(r"/cu\d+$", index) and args["CUDA_IMAGE"].startswith("nvidia/cuda:")
        cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", args["CUDA_IMAGE"])
        assert index.endswith(f"/cu{cuda.group(1)}{cuda.group(2)}"), (
            "CUDA base and torch wheels differ"
        )
