"""Reasoning over gRPC: GenerateResponse.reasoning_content apart from `text`, whole and
streamed, through the pipeline REST shares (service/reasoning.py); the model's text is forced
with a choice constraint that, with --structured-outputs-config '{"enable_in_reasoning":
true}', constrains the reasoning too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.proto.moeserve.v1 import inference_pb2 as pb
from tests.grpc.grpc_harness import GrpcServerThread

USER = [pb.ChatMessage(role="user", content="Which city is the capital of France?")]
THOUGHT, ANSWER = "Weigh Paris against Rome.", "Paris"


@pytest.fixture(scope="module")
def server(model_path) -> Iterator[GrpcServerThread]:
    config = '{"enable_in_reasoning": true}'
    with GrpcServerThread(
        model_path, reasoning_parser="deepseek_r1", structured_outputs_config=config
    ) as srv:
        yield srv


def _request(text: str, **more) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        params=pb.SamplingParams(max_tokens=60),
        structured_output=pb.StructuredOutput(choice=pb.Choice(options=[text])),
        **more,
    )


def test_reasoning_content_apart_from_text(server):
    request = _request(f"{THOUGHT}</think>{ANSWER}", messages=USER)
    whole = server.stub.Generate(request, timeout=60)
    assert (whole.reasoning_content, whole.text, whole.finish_reason) == (THOUGHT, ANSWER, "stop")
    chunks = list(server.stub.GenerateStream(request, timeout=60))
    assert "".join(c.reasoning_content for c in chunks) == THOUGHT
    assert "".join(c.text for c in chunks) == ANSWER
    assert chunks[-1].finish_reason == "stop"
    assert all("think>" not in c.reasoning_content + c.text for c in chunks)


def test_a_prompt_completion_does_not_reason(server):
    """Reasoning parsers apply to chats (messages), as vLLM's to chat completions."""
    text = f"{THOUGHT}</think>{ANSWER}"
    whole = server.stub.Generate(_request(text, prompt="The capital of France"), timeout=60)
    assert (whole.reasoning_content, whole.text) == ("", text)
