"""loadtest/ is a client of the public APIs: it imports none of the server's code, and its
gRPC stubs are compiled from the .proto (loadtest/grpc_client_stubs.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
OUR_PACKAGES = {"service", "inference", "telemetry", "bench"}


def _imported_top_level(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(LOADTEST.glob("*.py")), ids=lambda p: p.name)
def test_loadtest_imports_none_of_the_servers_code(path):
    assert not _imported_top_level(path) & OUR_PACKAGES


def test_grpc_stubs_compile_from_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    # A fresh process: the server's stubs register the same message names in protobuf's
    # default pool, which would refuse a second file defining them.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(LOADTEST)!r})\n"
        "from grpc_client_stubs import load_inference_stubs\n"
        "pb, rpc = load_inference_stubs()\n"
        "assert load_inference_stubs() == (pb, rpc)\n"
        "request = pb.GenerateRequest(prompt='hi', params=pb.SamplingParams(max_tokens=3))\n"
        "assert pb.GenerateRequest.FromString(request.SerializeToString()) == request\n"
        "assert callable(rpc.InferenceStub)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('service', 'inference')]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
