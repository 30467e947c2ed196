"""moeserve's gRPC client stubs, compiled from the API's .proto when a load test starts.

loadtest/ talks to the server only through its public APIs, so it does not import the
server's generated code (service/proto/...): like any gRPC client it compiles the contract,
the .proto file, itself. Compiled at start rather than kept as a generated copy in loadtest/:
the stubs always match the checkout's .proto (no copy to go stale, no make target to
remember), and grpcio-tools comes with locust (both in the dev extra). It takes a fraction
of a second, once per process; the modules live on in memory, the folder does not.
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROTO = Path(__file__).resolve().parents[1] / "service/proto/moeserve/v1/inference.proto"


@functools.cache
def load_inference_stubs() -> tuple[ModuleType, ModuleType]:
    """(inference_pb2, inference_pb2_grpc) compiled from PROTO, once per process."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("GrpcUser needs grpcio-tools (pip install grpcio-tools)") from exc
    with tempfile.TemporaryDirectory(prefix="moeserve-grpc-stubs-") as out:
        # The proto's own folder as include path: the modules are top-level inference_pb2
        # and inference_pb2_grpc, and the latter imports the former by that name.
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            PROTO.name,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc could not compile {PROTO}")
        sys.path.insert(0, out)
        try:
            messages = importlib.import_module("inference_pb2")
            services = importlib.import_module("inference_pb2_grpc")
        finally:
            sys.path.remove(out)
    return messages, services
