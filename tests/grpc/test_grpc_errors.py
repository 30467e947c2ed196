"""Status codes of the gRPC API: every malformed input is INVALID_ARGUMENT naming the field,
auth, overload, draining; deadlines and cancels abort the request and free its KV blocks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.proto.moeserve.v1 import inference_pb2 as pb
from tests.grpc.grpc_harness import MAX_MODEL_LEN

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _code(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    try:
        result = fn(*args, **kwargs)
        if not hasattr(result, "SerializeToString"):  # a stream: consume it
            list(result)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _wait_until(predicate, timeout: float = 1.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


LONG = " ".join(["word"] * 2 * MAX_MODEL_LEN)  # over the context length
BAD_REQUESTS = {
    "empty": (pb.GenerateRequest(), "prompt"),
    "prompt_and_messages": (
        pb.GenerateRequest(prompt="a", messages=[pb.ChatMessage(role="user", content="b")]),
        "prompt and messages",
    ),
    "max_tokens_0": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(max_tokens=0)),
        "params.max_tokens",
    ),
    "over_context": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(max_tokens=MAX_MODEL_LEN)),
        "params.max_tokens",
    ),
    "long_prompt": (pb.GenerateRequest(prompt=LONG), "prompt"),
    "temperature": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(temperature=-1)),
        "params.temperature",
    ),
    "temperature_nan": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(temperature=float("nan"))),
        "params.temperature",
    ),
    "top_p": (pb.GenerateRequest(prompt="a", params=pb.SamplingParams(top_p=0)), "params.top_p"),
    "top_k": (pb.GenerateRequest(prompt="a", params=pb.SamplingParams(top_k=-5)), "params.top_k"),
    "min_tokens": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(max_tokens=2, min_tokens=3)),
        "params.min_tokens",
    ),
    "seed": (pb.GenerateRequest(prompt="a", params=pb.SamplingParams(seed=2**63)), "params.seed"),
    "logprobs": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(logprobs=21)),
        "params.logprobs",
    ),
    "n_over_limit": (pb.GenerateRequest(prompt="a", params=pb.SamplingParams(n=17)), "params.n"),
    "stop_empty": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(stop=[""])),
        "params.stop",
    ),
    "stop_token_ids": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(stop_token_ids=[10**6])),
        "params.stop_token_ids",
    ),
    "penalty": (
        pb.GenerateRequest(prompt="a", params=pb.SamplingParams(presence_penalty=3)),
        "params.presence_penalty",
    ),
    "empty_role": (pb.GenerateRequest(messages=[pb.ChatMessage(content="x")]), "messages[0].role"),
    "request_id": (pb.GenerateRequest(prompt="a", request_id="x" * 200), "request_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_invalid_argument_names_the_field(server, case):
    request, field = BAD_REQUESTS[case]
    for rpc in (server.stub.Generate, server.stub.GenerateStream):
        code, details = _code(rpc, request, timeout=10)
        assert code == INVALID, (rpc, code, details)
        assert field in details, details


def test_n_above_one_is_rejected_by_unary_generate(server):
    code, details = _code(
        server.stub.Generate, pb.GenerateRequest(prompt="a", params=pb.SamplingParams(n=2))
    )
    assert code == INVALID and "params.n" in details and "GenerateStream" in details


def test_tokenize_rejects_text_and_messages_together(server):
    request = pb.TokenizeRequest(text="a", messages=[pb.ChatMessage(role="user", content="b")])
    code, details = _code(server.stub.Tokenize, request, timeout=10)
    assert code == INVALID and "messages" in details


def test_undecodable_bytes_are_invalid_argument(server):
    raw = server.channel.unary_unary("/moeserve.v1.Inference/Generate")  # no serializers: raw bytes
    for body in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff", b"\x1a\x05\x08"):
        code, details = _code(raw, body, timeout=10)
        assert code == INVALID and "moeserve.v1.GenerateRequest" in details, (body, code, details)


def test_message_over_the_size_limit_is_resource_exhausted(server):
    prompt = "x" * (server.settings.max_body_bytes + 10)
    code, _ = _code(server.stub.Generate, pb.GenerateRequest(prompt=prompt), timeout=10)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_chat_without_template_is_invalid_argument(make_server):
    srv = make_server()
    srv.engine.tokenizer.chat_template = None
    code, details = _code(
        srv.stub.Generate, pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    )
    assert code == INVALID and "chat template" in details


def test_api_key_required_on_inference_only(make_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = make_server(api_key="sekrit")
    request = pb.GenerateRequest(prompt="hello", params=pb.SamplingParams(max_tokens=2))
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sekrit"),)):
        for rpc, req in (
            (srv.stub.Generate, request),
            (srv.stub.GenerateStream, request),
            (srv.stub.ModelInfo, pb.ModelInfoRequest()),
        ):
            code, details = _code(rpc, req, metadata=metadata, timeout=10)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (rpc, metadata, code)
            assert "authorization" in details
    ok = srv.stub.Generate(request, metadata=(("authorization", "Bearer sekrit"),), timeout=10)
    assert len(ok.token_ids) >= 1
    health = health_pb2_grpc.HealthStub(srv.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open


def test_full_waiting_queue_is_resource_exhausted(make_server):
    srv = make_server(max_num_seqs=1, max_waiting=1)
    request = pb.GenerateRequest(
        prompt="burst", params=pb.SamplingParams(max_tokens=128, ignore_eos=True)
    )
    calls = [srv.stub.Generate.future(request, timeout=30) for _ in range(8)]
    codes, retry_after = [], []
    for call in calls:
        try:
            call.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError:
            codes.append(call.code())
            retry_after += [v for k, v in call.trailing_metadata() or () if k == "retry-after"]
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert retry_after and all(v == "1" for v in retry_after)
    assert srv.state.in_flight == 0 and srv.kv_blocks_used == 0


def test_draining_refuses_new_requests_and_finishes_in_flight_ones(make_server):
    srv = make_server()
    stream = srv.stub.GenerateStream(
        pb.GenerateRequest(
            prompt="in flight", params=pb.SamplingParams(max_tokens=40, ignore_eos=True)
        ),
        timeout=30,
    )
    first = next(stream)
    srv.state.draining = True
    code, details = _code(srv.stub.Generate, pb.GenerateRequest(prompt="late"), timeout=10)
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 40


def test_graceful_stop_lets_in_flight_streams_finish(make_server):
    srv = make_server()
    stream = srv.stub.GenerateStream(
        pb.GenerateRequest(
            prompt="in flight", params=pb.SamplingParams(max_tokens=40, ignore_eos=True)
        ),
        timeout=30,
    )
    next(stream)
    stopper = threading.Thread(target=srv.run, args=(srv.server.stop(10),))
    stopper.start()
    rest = list(stream)
    stopper.join(15)
    assert rest[-1].finish_reason == "length"
    code, _ = _code(srv.stub.Generate, pb.GenerateRequest(prompt="after stop"), timeout=5)
    assert code == grpc.StatusCode.UNAVAILABLE


# ---- deadlines and cancels free the request's KV blocks -------------------------------------
@pytest.fixture
def aborted(server):
    """request ids the engine finished as "abort", from the step stats that also report their
    blocks freed (appended on the event loop thread)."""
    ids: list[str] = []

    def listener(stats) -> None:
        ids.extend(f.request_id for f in stats.finished if f.finish_reason == "abort")

    server.engine.add_stats_listener(listener)
    yield ids
    server.engine.remove_stats_listener(listener)


def _long_request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="never ending story",
        request_id=rid,
        params=pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True),
    )


def test_deadline_mid_stream_aborts_and_frees_kv(server, aborted):
    stream = server.stub.GenerateStream(_long_request("deadline-stream"), timeout=0.6)
    next(stream)
    assert server.kv_blocks_used > 0
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until(lambda: server.kv_blocks_used == 0 and aborted, timeout=1.0)
    assert aborted == ["deadline-stream"]
    assert server.state.in_flight == 0 and server.engine.num_requests == 0


def test_deadline_on_unary_generate_aborts_and_frees_kv(server, aborted):
    code, _ = _code(server.stub.Generate, _long_request("deadline-unary"), timeout=0.4)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until(lambda: server.kv_blocks_used == 0 and aborted, timeout=1.0)
    assert aborted == ["deadline-unary"]


def test_client_cancel_aborts_and_frees_kv(server, aborted):
    stream = server.stub.GenerateStream(_long_request("cancelled"), timeout=30)
    next(stream), next(stream)
    assert server.kv_blocks_used > 0
    stream.cancel()
    _wait_until(lambda: server.kv_blocks_used == 0 and aborted, timeout=1.0)
    assert aborted == ["cancelled"] and server.state.in_flight == 0


def test_an_error_in_one_request_does_not_fail_the_others(server):
    good = pb.GenerateRequest(
        prompt="fine", params=pb.SamplingParams(max_tokens=8, ignore_eos=True)
    )
    bad = pb.GenerateRequest(prompt="a", params=pb.SamplingParams(top_p=2))
    with ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(lambda r: _code(server.stub.Generate, r, timeout=20), [good, bad] * 3)
        )
    assert [c for c, _ in results] == [grpc.StatusCode.OK, INVALID] * 3


# ---- property: no input makes the server answer INTERNAL/UNKNOWN ----------------------------
_u32 = st.integers(0, 2**32 - 1)
_f32 = st.floats(width=32)  # any float32, NaN and infinities included
_text = st.text(max_size=40)
# Mostly in range (so many requests really generate), plus at most one field anywhere in its
# proto type's domain.
_valid_params = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 4),
        "min_tokens": st.integers(0, 2),
        "temperature": st.floats(0, 2, width=32),
        "top_p": st.floats(0.0625, 1, width=32),
        "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 0.5, width=32),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 1023), max_size=3),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.floats(-2, 2, width=32),
        "frequency_penalty": st.floats(-2, 2, width=32),
        "repetition_penalty": st.floats(0.5, 2, width=32),
        "logprobs": st.integers(0, 5),
        "n": st.integers(1, 3),
    },
)
_wild_field = st.one_of(
    st.tuples(st.sampled_from(["max_tokens", "min_tokens", "logprobs", "n"]), _u32),
    st.tuples(
        st.sampled_from(
            [
                "temperature",
                "top_p",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            ]
        ),
        _f32,
    ),
    st.tuples(st.just("top_k"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("seed"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("stop"), st.lists(st.text(max_size=4), max_size=10)),
    st.tuples(st.just("stop_token_ids"), st.lists(_u32, max_size=3)),
)
_params = st.builds(
    lambda valid, wild: {**valid, **dict(wild)},
    _valid_params,
    st.lists(_wild_field, max_size=1) | st.just([]),
)
_messages = st.lists(
    st.builds(
        pb.ChatMessage, role=st.sampled_from(["user", "assistant", "system"]) | _text, content=_text
    ),
    min_size=1,
    max_size=3,
)
_inputs = st.integers(0, 9).flatmap(
    lambda k: (
        st.just({})
        if k == 0
        else st.builds(lambda p, m: {"prompt": p, "messages": m}, _text, _messages)
        if k == 1
        else st.builds(lambda p: {"prompt": p}, st.text(min_size=1, max_size=40))
        if k < 6
        else st.builds(lambda m: {"messages": m}, _messages)
    )
)
_request_ids = st.integers(0, 3).flatmap(
    lambda k: (
        st.text(max_size=140)
        if k == 0
        else st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)
        if k == 1
        else st.just("")
    )
)
_requests = st.builds(
    lambda inputs, params, rid: pb.GenerateRequest(
        **inputs, params=pb.SamplingParams(**params), request_id=rid
    ),
    _inputs,
    _params,
    _request_ids,
)


def _mutate(data: bytes, cut: int, flip: int, byte: int) -> bytes:
    """Truncates or overwrites one byte of a valid message."""
    if not data:
        return bytes([byte])
    if cut % 2:
        return data[: cut % len(data)]
    i = flip % len(data)
    return data[:i] + bytes([byte]) + data[i + 1 :]


_bodies = st.binary(max_size=64) | st.builds(
    _mutate,
    _requests.map(lambda r: r.SerializeToString()),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=_requests, streaming=st.booleans())
def test_generated_requests_never_get_internal_or_unknown(server, request, streaming):
    if not request.params.HasField("max_tokens"):
        request.params.max_tokens = 4  # the default (16) only makes the run slower
    rpc = server.stub.GenerateStream if streaming else server.stub.Generate
    code, details = _code(rpc, request, timeout=30)
    assert code in (grpc.StatusCode.OK, INVALID), (code, details, request)
    if code == INVALID:
        assert details


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=_bodies)
def test_random_bytes_never_get_internal_or_unknown(server, body):
    raw = server.channel.unary_unary("/moeserve.v1.Inference/Generate")
    code, details = _code(raw, body, timeout=30)
    assert code in (grpc.StatusCode.OK, INVALID), (code, details, body)
