"""`include_metrics` on a server started without --enable-per-request-metrics (the numbers
themselves: tests/service/test_per_request_metrics.py)."""

from __future__ import annotations

import grpc
import pytest

from service.proto.moeserve.v1 import inference_pb2 as pb


def test_include_metrics_without_the_flag_is_invalid_argument(server):
    request = pb.GenerateRequest(
        prompt="Hello", params=pb.SamplingParams(max_tokens=2), include_metrics=True
    )
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "include_metrics" in info.value.details()
