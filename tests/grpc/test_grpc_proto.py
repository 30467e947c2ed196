"""The checked-in generated code is exactly what the generator makes from the .proto, and the
server needs only grpcio/protobuf at runtime (grpcio-tools is a dev extra)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Version stamps depend on the installed grpcio-tools; everything else must match byte for byte.
_STAMPS = [
    (re.compile(r"^# Protobuf Python Version: .*$", re.MULTILINE), "# Protobuf Python Version: X"),
    (
        re.compile(
            r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"
        ),
        r"\1 X, X, X,",
    ),
    (
        re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE),
        "GRPC_GENERATED_VERSION = 'X'",
    ),
]


def _normalized(text: str) -> str:
    for pattern, repl in _STAMPS:
        text = pattern.sub(repl, text)
    return text


def test_regenerating_yields_the_checked_in_files(tmp_path):
    pytest.importorskip("grpc_tools")
    from service.proto import generate

    written = generate.generate(tmp_path)
    assert len(written) == 3 * len(generate.PROTOS)
    for fresh in written:
        checked_in = ROOT / fresh.relative_to(tmp_path)
        assert checked_in.exists(), f"{checked_in} is missing: run python -m service.proto.generate"
        assert _normalized(checked_in.read_text()) == _normalized(fresh.read_text()), (
            f"{checked_in.relative_to(ROOT)} differs from the generator's output: "
            "edit the .proto and run python -m service.proto.generate"
        )


def test_server_imports_without_grpc_tools():
    code = (
        "import sys; sys.modules['grpc_tools'] = None\n"
        "import service.grpc_server as g\n"
        "assert g.SERVICE_NAME == 'moeserve.v1.Inference', g.SERVICE_NAME\n"
        "assert not any(m.startswith('grpc_tools') for m in sys.modules if sys.modules[m])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_proto_package_and_service_are_the_specified_ones():
    from service.proto.moeserve.v1 import inference_pb2 as pb

    assert pb.DESCRIPTOR.package == "moeserve.v1"
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert methods == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "GenerateStream": ("GenerateRequest", "GenerateResponse", True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "ModelInfo": ("ModelInfoRequest", "ModelInfoResponse", False),
    }
    from inference import SamplingParams

    # the grammar constraint travels beside the params, as GenerateRequest.structured_output;
    # prompt_logprobs too, as GenerateRequest.prompt_logprobs (vLLM's request field);
    # reasoning_end is the service's (its reasoning parser's end marker)
    assert {f.name for f in pb.SamplingParams.DESCRIPTOR.fields} == set(
        SamplingParams.__struct_fields__
    ) - {"structured_outputs", "prompt_logprobs", "reasoning_end"}
    request = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert {"structured_output", "tools", "tool_choice", "parallel_tool_calls"} <= set(request)
    assert "prompt_logprobs" in request
    assert "prompt_logprobs" in pb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert "tool_calls" in pb.GenerateResponse.DESCRIPTOR.fields_by_name
