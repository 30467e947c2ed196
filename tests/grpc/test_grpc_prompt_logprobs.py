"""GenerateRequest.prompt_logprobs (vLLM's prompt_logprobs, issue 39): prompt positions 1..
scored on the prefill, against transformers' float32 log-softmax; unary and streamed (on the
first message only, also with n > 1); out of range: INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest
import torch

from service.proto.moeserve.v1 import inference_pb2 as pb
from tests.inference.parity_checks import hf_model

PROMPT = "The quick brown fox jumps over the lazy dog"


def _req(prompt_logprobs: int, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=PROMPT, params=pb.SamplingParams(**params), prompt_logprobs=prompt_logprobs
    )


def _check(scored, ids: list[int], model_path) -> None:
    with torch.inference_mode():
        want = hf_model(model_path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert [e.token_id for e in scored] == ids[1:]
    for pos, e in enumerate(scored, start=1):
        row = want[pos - 1]
        assert e.logprob == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        assert [t.logprob for t in e.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


def test_unary_and_streamed_prompt_logprobs(server, model_path):
    ids = server.engine.tokenizer.encode(PROMPT)
    resp = server.stub.Generate(_req(2, max_tokens=2, temperature=0.0), timeout=10)
    _check(resp.prompt_logprobs, ids, model_path)
    stream = list(server.stub.GenerateStream(_req(2, max_tokens=3, n=2, seed=1), timeout=10))
    assert [len(m.prompt_logprobs) > 0 for m in stream] == [True] + [False] * (len(stream) - 1)
    _check(stream[0].prompt_logprobs, ids, model_path)
    plain = server.stub.Generate(pb.GenerateRequest(prompt=PROMPT), timeout=10)
    assert len(plain.prompt_logprobs) == 0


def test_out_of_range_is_invalid_argument_naming_the_field(server):
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Generate(_req(21, max_tokens=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in err.value.details()
