"""Property tests: generated request bodies never get a 5xx, and errors keep the envelope."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench.harness import iter_sse

_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Anything JSON can say, for fields given the wrong type.
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
text = st.text(max_size=40)
some_text = st.text(min_size=1, max_size=40)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": some_text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2
        ),
    },
    optional={"name": some_text},
)

# Valid values (mostly small, so generation stays short), then a few fields made junk.
common = {
    "model": st.sampled_from(["demo", "demo", "demo", "nope"]),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**63 - 1),
    "stop": some_text | st.lists(some_text, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 2000),
    "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 10),
    "stop_token_ids": st.lists(st.integers(0, 1023), max_size=3),
    "ignore_eos": st.booleans(),
    "user": text,
    "logit_bias": st.none(),
}
COMPLETION = {
    **common,
    "prompt": some_text | st.lists(st.integers(0, 1023), min_size=1, max_size=8),
    "logprobs": st.integers(0, 5),
    "echo": st.just(False),
}
CHAT = {
    **common,
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "tools": st.none(),
}


@st.composite
def bodies(draw, fields: dict, required: str) -> dict:
    always = {required: fields[required], "max_tokens": st.integers(1, 4), "stream": st.booleans()}
    body = draw(
        st.fixed_dictionaries(always, optional={k: v for k, v in fields.items() if k not in always})
    )
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # mostly valid; sometimes break a field
        key = draw(st.sampled_from(sorted([*fields, "max_tokens", "unknown_field"])))
        body[key] = draw(junk | st.integers(-3, 0) | st.just(""))
    if body.get("logprobs") is False:
        body.pop("top_logprobs", None)
    return body


completion_body = bodies(COMPLETION, "prompt")
chat_body = bodies(CHAT, "messages")


def _check(r: httpx.Response, stream_lines: list[str] | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    assert r.headers.get("x-request-id")
    event(f"status {r.status_code}" + (" (stream)" if stream_lines is not None else ""))
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
    elif stream_lines is not None:
        # `data: {json object}` lines ending with `data: [DONE]` (SseError otherwise); an
        # in-stream failure is an event with an "error" object (generated text may itself
        # contain the word "error", so events are parsed rather than searched)
        events = [e for _, e in iter_sse(stream_lines)]
        assert not any("error" in e for e in events)


def _post(http: httpx.Client, path: str, body: dict, model_name: str) -> None:
    if body.get("model") == "demo":
        body["model"] = model_name
    content = json.dumps(body, allow_nan=False)
    with http.stream(
        "POST", path, content=content, headers={"content-type": "application/json"}
    ) as r:
        lines = None
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            lines = list(r.iter_lines())
        else:
            r.read()
    _check(r, lines)


@pytest.mark.slow
@_SETTINGS
@given(body=completion_body)
def test_completions_never_5xx(http, model_name, body):
    _post(http, "/v1/completions", body, model_name)


@pytest.mark.slow
@_SETTINGS
@given(body=chat_body)
def test_chat_completions_never_5xx(http, model_name, body):
    _post(http, "/v1/chat/completions", body, model_name)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    raw=st.binary(max_size=200)
    | st.text(max_size=80).map(lambda s: ('{"prompt": "' + s).encode("utf-8", "surrogatepass"))
)
@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
)
def test_raw_bytes_never_5xx(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text)
    assert r.status_code == 400 or r.status_code == 200
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_server_still_healthy_after_fuzzing(http, server, wait_idle):
    assert http.get("/ready").status_code == 200
    wait_idle(server, 5)
