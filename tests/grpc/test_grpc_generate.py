"""gRPC generation, tokenization and model info against the real server on a free port."""

from __future__ import annotations

from service.proto.moeserve.v1 import inference_pb2 as pb
from tests.grpc.grpc_harness import MAX_MODEL_LEN, MODEL_NAME


def _req(prompt="The quick brown fox", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))


def test_unary_generate_returns_text_tokens_and_usage(server):
    resp = server.stub.Generate(_req(max_tokens=6, temperature=0.0, ignore_eos=True), timeout=10)
    prompt_ids = server.engine.tokenizer.encode("The quick brown fox")
    assert len(resp.token_ids) == 6 and resp.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 6
    assert resp.text == server.engine.tokenizer.decode(
        list(resp.token_ids), skip_special_tokens=True
    )
    assert resp.request_id.startswith("grpc-")


def test_stream_deltas_concatenate_to_the_unary_result_for_the_same_seed(server):
    params = {"max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    unary = server.stub.Generate(_req(**params), timeout=10)
    chunks = list(server.stub.GenerateStream(_req(**params), timeout=10))
    assert len(chunks) >= 2  # one message per engine output, not one blob
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert all(c.finish_reason == "" for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    assert all(not c.HasField("usage") for c in chunks[:-1])
    assert chunks[-1].usage == unary.usage and unary.usage.completion_tokens == 12


def test_request_id_is_echoed(server):
    resp = server.stub.Generate(
        pb.GenerateRequest(
            prompt="hi", request_id="my-id-1", params=pb.SamplingParams(max_tokens=2)
        ),
        timeout=10,
    )
    assert resp.request_id == "my-id-1"


def test_chat_messages_use_the_chat_template(server):
    messages = [
        pb.ChatMessage(role="system", content="be brief"),
        pb.ChatMessage(role="user", content="hello"),
    ]
    params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    chat = server.stub.Generate(pb.GenerateRequest(messages=messages, params=params), timeout=10)
    rendered = server.engine.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    plain = server.stub.Generate(pb.GenerateRequest(prompt=rendered, params=params), timeout=10)
    assert (
        chat.token_ids == plain.token_ids and chat.usage.prompt_tokens == plain.usage.prompt_tokens
    )
    tok = server.stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=10)
    assert tok.count == chat.usage.prompt_tokens


def test_stream_with_n_samples_tags_each_message_with_its_index(server):
    chunks = list(
        server.stub.GenerateStream(_req(max_tokens=5, n=3, seed=1, ignore_eos=True), timeout=10)
    )
    by_index: dict[int, list] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1, 2]
    for msgs in by_index.values():
        assert sum(len(m.token_ids) for m in msgs) == 5
        assert [m.finish_reason for m in msgs if m.finish_reason] == [
            "length"
        ]  # once, on its last message
    assert chunks[-1].usage.completion_tokens == 15
    assert sum(c.HasField("usage") for c in chunks) == 1


def test_logprobs_come_back_per_token(server):
    resp = server.stub.Generate(
        _req(max_tokens=4, logprobs=2, temperature=0.0, ignore_eos=True), timeout=10
    )
    assert [lp.token_id for lp in resp.logprobs] == list(resp.token_ids)
    assert all(lp.logprob <= 0.0 and len(lp.top) == 2 for lp in resp.logprobs)
    stream = list(
        server.stub.GenerateStream(_req(max_tokens=4, logprobs=0, temperature=0.0, ignore_eos=True))
    )
    assert [lp.token_id for c in stream for lp in c.logprobs] == list(resp.token_ids)


def test_stop_string_finishes_with_stop(server):
    full = server.stub.Generate(_req(max_tokens=8, temperature=0.0, ignore_eos=True), timeout=10)
    stop = next(ch for ch in full.text[len(full.text) // 2 :] if ch.isalnum())
    resp = server.stub.Generate(
        _req(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop]), timeout=10
    )
    assert (
        resp.finish_reason == "stop" and stop not in resp.text and full.text.startswith(resp.text)
    )


def test_tokenize_round_trip(server):
    text = "Hello gRPC world, tokens please."
    resp = server.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    tokenizer = server.engine.tokenizer
    assert list(resp.token_ids) == tokenizer.encode(text) and resp.count == len(resp.token_ids) > 0
    assert tokenizer.decode(list(resp.token_ids), skip_special_tokens=True) == text
    assert list(resp.tokens) == tokenizer.convert_ids_to_tokens(list(resp.token_ids))
    assert resp.max_model_len == MAX_MODEL_LEN


def test_model_info_describes_the_served_model(server):
    info = server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    args = server.engine.args
    assert info.model_name == MODEL_NAME and info.architecture == "MixtralForCausalLM"
    assert (info.vocab_size, info.num_layers, info.num_experts, info.num_experts_per_token) == (
        args.vocab_size,
        args.num_layers,
        args.num_experts,
        args.top_k,
    )
    assert info.max_model_len == MAX_MODEL_LEN and info.dtype == "float32" and info.device == "cpu"
