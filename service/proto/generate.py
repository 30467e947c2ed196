"""Regenerates the checked-in Python code for moeserve's protos (needs grpcio-tools, a dev extra).

    python -m service.proto.generate [OUT_DIR]

Protos are compiled with the repository root as the include path, so the generated modules
import each other as `service.proto.moeserve.v1...` (no sys.path tricks); the proto package
stays `moeserve.v1`. OUT_DIR defaults to the repository root, i.e. the files land next to
their .proto. tests/grpc/test_grpc_proto.py regenerates into a temporary folder and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ["service/proto/moeserve/v1/inference.proto"]


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Writes <name>_pb2.py, <name>_pb2.pyi and <name>_pb2_grpc.py for every proto; returns them."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    written = []
    for proto in PROTOS:
        stem = out_dir / proto.removesuffix(".proto")
        written += [
            stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
        ]
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
