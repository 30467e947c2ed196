"""Every error case of SPEC section 6 over raw HTTP: OpenAI envelope, right status, never 5xx."""

from __future__ import annotations

import asyncio

import httpx
import pytest

MAX_MODEL_LEN, MAX_BODY_BYTES = (
    256,
    64 * 1024,
)  # the limits conftest.make_settings gives test servers

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def test_limits_match_the_test_server(server):
    assert server.engine.max_model_len == MAX_MODEL_LEN
    assert server.settings.max_body_bytes == MAX_BODY_BYTES


def assert_envelope(
    r: httpx.Response, status: int, param: str | None = "unset", code: str | None = "unset"
) -> dict:
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "unset":
        assert error["param"] == param, error
    if code != "unset":
        assert error["code"] == code, error
    return error


BAD_JSON_BODIES = [
    pytest.param(COMP, {"prompt": "hi", "max_tokens": 0}, "max_tokens", id="max_tokens-0"),
    pytest.param(COMP, {"prompt": "hi", "max_tokens": -5}, "max_tokens", id="max_tokens-negative"),
    pytest.param(
        CHAT,
        {"messages": USER, "max_completion_tokens": 0},
        "max_completion_tokens",
        id="chat-max_tokens-0",
    ),
    pytest.param(
        COMP, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens", id="over-max_model_len"
    ),
    pytest.param(
        COMP, {"prompt": "hi " * 400, "max_tokens": 1}, "prompt", id="prompt-over-max_model_len"
    ),
    pytest.param(  # refused by its head alone (inference.prompts.encode_within)
        COMP, {"prompt": "hi " * 5000, "max_tokens": 1}, "prompt", id="prompt-far-over"
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": "hi " * 5000}]},
        "prompt",
        id="chat-far-over-max_model_len",
    ),
    pytest.param(COMP, {"prompt": [5] * 5000}, "prompt", id="token-ids-far-over"),
    pytest.param(COMP, {"prompt": "hi", "n": 17}, "n", id="n-over-limit"),
    pytest.param(COMP, {"prompt": "hi", "n": 0}, "n", id="n-zero"),
    pytest.param(COMP, {"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param(COMP, {"prompt": []}, "prompt", id="empty-token-list"),
    pytest.param(COMP, {"prompt": ["a", "b"]}, "prompt", id="batched-prompts"),
    pytest.param(COMP, {"prompt": [1, "x"]}, "prompt", id="mixed-prompt-list"),
    pytest.param(COMP, {"prompt": [5, 10**9]}, "prompt", id="token-id-out-of-vocab"),
    pytest.param(COMP, {"max_tokens": 3}, "prompt", id="missing-prompt"),
    pytest.param(CHAT, {"messages": []}, "messages", id="empty-messages"),
    pytest.param(
        CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", id="bad-role"
    ),
    pytest.param(COMP, {"prompt": 5}, "prompt", id="prompt-wrong-type"),
    pytest.param(
        COMP, {"prompt": "hi", "temperature": "hot"}, "temperature", id="temperature-wrong-type"
    ),
    pytest.param(
        COMP, {"prompt": "hi", "temperature": -1}, "temperature", id="temperature-negative"
    ),
    pytest.param(COMP, {"prompt": "hi", "top_p": 0}, "top_p", id="top_p-zero"),
    pytest.param(COMP, {"prompt": "hi", "max_tokens": True}, "max_tokens", id="bool-for-int"),
    pytest.param(COMP, {"prompt": "hi", "logprobs": 21}, "logprobs", id="logprobs-over-limit"),
    pytest.param(COMP, {"prompt": "hi", "seed": -1}, "seed", id="seed-negative"),
    pytest.param(COMP, {"prompt": "hi", "stop": [""]}, "stop", id="empty-stop"),
    pytest.param(
        COMP, {"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", id="stop-token-oov"
    ),
    pytest.param(COMP, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", id="huge-int"),
    pytest.param(COMP, {"prompt": "hi", "frobnicate": 1}, "frobnicate", id="unknown-field"),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": "x", "extra": 1}]},
        "extra",
        id="unknown-nested",
    ),
    pytest.param(COMP, {"prompt": "hi", "suffix": "x"}, "suffix", id="unsupported-suffix"),
    pytest.param(
        COMP,
        {"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 1},
        "min_tokens",
        id="echo-max_tokens-0-min_tokens",
    ),
    pytest.param(
        COMP,
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        id="prompt_logprobs-streamed",
    ),
    pytest.param(COMP, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", id="pl-21"),
    pytest.param(
        CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools", id="unsupported-tools"
    ),
    pytest.param(
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        "top_logprobs",
        id="top_logprobs-without-logprobs",
    ),
    pytest.param(
        CHAT,
        {"messages": USER, "stream_options": {"include_usage": 1, "x": 2}},
        "x",
        id="unknown-stream-option",
    ),
    pytest.param(COMP, [1, 2], None, id="body-not-an-object"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_JSON_BODIES)
def test_invalid_requests_are_400_with_the_offending_field(http, model_name, path, body, param):
    if isinstance(body, dict):
        body = {"model": model_name, **body}
    error = assert_envelope(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param or param in error["message"], error


RAW_BODIES = [
    pytest.param(b'{"prompt": "hi", ', id="truncated-json"),
    pytest.param(b"not json at all", id="not-json"),
    pytest.param(b"", id="empty-body"),
    pytest.param(b'{"prompt": "\xff\xfe\xfd"}', id="invalid-utf8"),
    pytest.param(b'{"prompt": "a\x01\x02b"}', id="raw-control-characters"),
    pytest.param(b'{"prompt": "\\ud800"}', id="lone-surrogate"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 1e999}', id="number-out-of-range"),
    pytest.param(b'{"prompt": "hi", "temperature": NaN}', id="nan"),
    # nested far past the decoder's recursion limit, yet under the body limit
    pytest.param(b"[" * 20_000 + b"]" * 20_000, id="deeply-nested-list"),
    pytest.param(b'{"a":' * 10_000 + b"1" + b"}" * 10_000, id="deeply-nested-object"),
    pytest.param(b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", id="deeply-nested-prompt"),
    pytest.param(b'{"prompt": "hi", "max_tokens": "5"}', id="number-as-string"),
    pytest.param(b'{"prompt": "hi", "stream": "true"}', id="bool-as-string"),
    pytest.param(b'"hello"', id="body-a-string"),
    pytest.param(b"null", id="body-null"),
    pytest.param(b'{"prompt": "hi"} trailing', id="trailing-garbage"),
]


@pytest.mark.parametrize("path", [COMP, CHAT])
@pytest.mark.parametrize("body", RAW_BODIES)
def test_malformed_bodies_are_400(http, path, body):
    error = assert_envelope(
        http.post(path, content=body, headers={"content-type": "application/json"}), 400
    )
    assert error["type"] == "invalid_request_error"


def test_escaped_control_characters_are_valid_input(http, model_name):
    r = http.post(
        COMP, json={"model": model_name, "prompt": "a\u0000b\u0007\u001b[0m", "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0


def test_body_over_limit_is_413(http, model_name):
    body = {"model": model_name, "prompt": "x" * (MAX_BODY_BYTES + 10)}
    error = assert_envelope(http.post(COMP, json=body), 413, code="request_too_large")
    assert str(MAX_BODY_BYTES) in error["message"]


def test_huge_prompt_under_the_body_limit_is_400(http, model_name):
    body = {"model": model_name, "prompt": "word " * (MAX_BODY_BYTES // 6), "max_tokens": 1}
    assert_envelope(http.post(COMP, json=body), 400, param="prompt")


def test_unknown_model_is_404(http):
    error = assert_envelope(
        http.post(COMP, json={"model": "gpt-17", "prompt": "hi"}),
        404,
        param="model",
        code="model_not_found",
    )
    assert "gpt-17" in error["message"]
    assert_envelope(
        http.post(CHAT, json={"model": "gpt-17", "messages": USER}), 404, code="model_not_found"
    )


def test_unknown_route_and_wrong_method(http):
    assert_envelope(http.get("/v1/nothing-here"), 404, code="not_found")
    r = http.get(COMP)
    assert_envelope(r, 405, code="method_not_allowed")
    assert "POST" in r.headers.get("allow", "")


def test_missing_chat_template_is_400(http, server, model_name):
    tokenizer = server.engine.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        error = assert_envelope(
            http.post(CHAT, json={"model": model_name, "messages": USER}),
            400,
            code="no_chat_template",
        )
        assert "chat template" in error["message"]
    finally:
        tokenizer.chat_template = saved
    assert (
        http.post(CHAT, json={"model": model_name, "messages": USER, "max_tokens": 1}).status_code
        == 200
    )


def test_api_key_guards_v1_routes_only(http, api_key, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    assert_envelope(http.post(COMP, json=body), 401, code="invalid_api_key")
    assert_envelope(http.post(COMP, json=body, headers={"authorization": "Bearer wrong"}), 401)
    assert_envelope(http.post(COMP, json=body, headers={"authorization": f"Basic {api_key}"}), 401)
    assert_envelope(http.get("/v1/models"), 401)
    # the guard runs before the body is parsed: no hint about the payload without a key
    assert_envelope(http.post(COMP, content=b"{bad"), 401)
    ok = http.post(COMP, json=body, headers={"authorization": f"Bearer {api_key}"})
    assert ok.status_code == 200
    assert http.get("/v1/models", headers={"authorization": f"bearer {api_key}"}).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200


@pytest.mark.slow
def test_overload_gets_429_with_retry_after_and_nothing_is_lost(start_server, wait_idle):
    with start_server(max_waiting=2, max_num_seqs=1) as srv:

        async def fire() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                body = {"prompt": "count to ten", "max_tokens": 64, "ignore_eos": True}
                return await asyncio.gather(*(c.post(COMP, json=body) for _ in range(20)))

        responses = asyncio.run(asyncio.wait_for(fire(), 90))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        for r in responses:
            if r.status_code == 429:
                assert_envelope(r, 429, code="queue_full")
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert int(r.headers["retry-after"]) >= 1
            else:
                assert r.json()["usage"]["completion_tokens"] == 64
        wait_idle(srv, 5)


def test_a_prompt_far_over_the_context_is_refused_by_its_head(http, model_name):
    error = assert_envelope(
        http.post(COMP, json={"model": model_name, "prompt": "hi " * 20000, "max_tokens": 1}), 400
    )
    assert "characters alone" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    # the tokenize endpoint has no context to fit: it counts all of it
    r = http.post("/tokenize", json={"model": model_name, "prompt": "hi " * 5000})
    assert r.status_code == 200 and r.json()["count"] >= 5000
