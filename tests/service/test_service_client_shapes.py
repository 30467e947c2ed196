"""The exact streamed request bodies (and headers) of the benchmark clients people point at a
vLLM-compatible server: guidellm's OpenAI HTTP backend and `vllm bench serve`.

Each shape below is copied from the client's source, field for field (values we choose, such
as the prompt and the token count, are the only difference), with the file and commit it was
taken from. Every one must stream to its end: 200, `data: {JSON}` events, `data: [DONE]`, text,
a finish reason, and the usage it asked for (`stream_options.include_usage`: one last chunk
with `choices: []`; vLLM's `continuous_usage_stats`: the usage so far on every chunk too).

Sources
- guidellm HEAD ee7a77457ba668b4b5ccb40f110518829893b36a (same request bodies as release
  v0.7.3, 39383552962841086d05e25c37b58a83ef06c758):
  src/guidellm/backends/openai/request_handlers.py, TextCompletionsRequestHandler.format and
  ChatCompletionsRequestHandler.format; src/guidellm/backends/openai/http.py,
  _prepare_resolve_request (drops every None value from the body with deep_filter, so the
  `"stop": None` the handlers set never reaches the wire) and _build_headers (Authorization
  only with an API key; httpx adds Content-Type: application/json).
- guidellm v0.5.0 adfa108ab1df6f2a1452d1037a71817a493303a8:
  src/guidellm/data/preprocessors/formatters.py (no None filtering yet: `"stop": null` is sent;
  include_usage only). v0.3.1 (src/guidellm/backend/openai.py, _completions_payload) sends
  the same fields.
- vLLM 02cfb534df5674737558730b10f23d1b7aef9b7c: vllm/benchmarks/lib/endpoint_request_func.py,
  async_request_openai_completions / async_request_openai_chat_completions with
  _update_payload_common (`ignore_eos` with --ignore-eos, then extra_body merged in),
  _get_headers (Content-Type only for chat; Authorization only with OPENAI_API_KEY) and
  _update_headers_common (x-request-id); vllm/benchmarks/serve.py (def9ce85ba10) builds
  extra_body from the sampling flags and defaults it to {"temperature": 0.0} (greedy), and the
  request id from --request-id-prefix (default f"bench-{uuid4().hex[:8]}-") plus the index.
  `"logprobs": request_func_input.logprobs` is None without --logprobs: aiohttp sends null.
- vLLM e7dffa683de59f5592d75896a56283e778c084f5: benchmarks/backend_request_func.py (the
  older script): the same bodies with "temperature": 0.0 inline, and
  `Authorization: Bearer {os.environ.get('OPENAI_API_KEY')}`, i.e. "Bearer None" without a key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.harness import read_sse

MAX_TOKENS = 8
PROMPT = "Once upon a time, in a land far away,"
REQUEST_ID = "bench-1a2b3c4d-0"  # vllm bench serve: --request-id-prefix default + index


@dataclass(frozen=True)
class Shape:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: Callable[[str], dict[str, Any]]  # model name -> the JSON body the client sends
    headers: dict[str, str]
    continuous_usage: bool  # stream_options.continuous_usage_stats

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"


# --- guidellm ------------------------------------------------------------------------------


def guidellm_text(model: str) -> dict[str, Any]:
    # TextCompletionsRequestHandler.format with stream=True and an output token count
    # (data.output_metrics.text_tokens), after deep_filter dropped "stop": None.
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "prompt": PROMPT,
    }


def guidellm_chat(model: str) -> dict[str, Any]:
    # ChatCompletionsRequestHandler.format: text columns become content parts.
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    }


def guidellm_v05_text(model: str) -> dict[str, Any]:
    # GenerativeTextCompletionsRequestFormatter.__call__ (v0.5.0): "stop": null on the wire.
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": MAX_TOKENS,
        "stop": None,
        "ignore_eos": True,
        "prompt": PROMPT,
    }


def guidellm_v05_chat(model: str) -> dict[str, Any]:
    # GenerativeChatCompletionsRequestFormatter.__call__ (v0.5.0).
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": MAX_TOKENS,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    }


# --- vllm bench serve ----------------------------------------------------------------------


def vllm_bench_completions(model: str) -> dict[str, Any]:
    # async_request_openai_completions; then ignore_eos (--ignore-eos) and extra_body
    # ({"temperature": 0.0}, serve.py's greedy default) merged in by _update_payload_common.
    return {
        "model": model,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": MAX_TOKENS,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


def vllm_bench_chat(model: str) -> dict[str, Any]:
    # async_request_openai_chat_completions with _get_chat_messages (text-only prompt).
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


def vllm_legacy_completions(model: str) -> dict[str, Any]:
    # benchmarks/backend_request_func.py async_request_openai_completions (e7dffa68).
    return {
        "model": model,
        "prompt": PROMPT,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": MAX_TOKENS,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def vllm_legacy_chat(model: str) -> dict[str, Any]:
    # benchmarks/backend_request_func.py async_request_openai_chat_completions (e7dffa68).
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "temperature": 0.0,
        "max_completion_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


JSON = {"Content-Type": "application/json"}
COMP, CHAT = "/v1/completions", "/v1/chat/completions"

GUIDELLM_CHAT = Shape(CHAT, guidellm_chat, JSON, True)

SHAPES = [
    pytest.param(Shape(COMP, guidellm_text, JSON, True), id="guidellm-text"),
    pytest.param(GUIDELLM_CHAT, id="guidellm-chat"),
    pytest.param(Shape(COMP, guidellm_v05_text, JSON, False), id="guidellm-0.5-text"),
    pytest.param(Shape(CHAT, guidellm_v05_chat, JSON, False), id="guidellm-0.5-chat"),
    pytest.param(
        # aiohttp adds Content-Type: application/json for json=; _get_headers sets none here.
        Shape(COMP, vllm_bench_completions, {"x-request-id": REQUEST_ID}, False),
        id="vllm-bench-completions",
    ),
    pytest.param(
        Shape(CHAT, vllm_bench_chat, {**JSON, "x-request-id": REQUEST_ID}, False),
        id="vllm-bench-chat",
    ),
    pytest.param(
        Shape(COMP, vllm_legacy_completions, {"Authorization": "Bearer None"}, False),
        id="vllm-legacy-completions",
    ),
    pytest.param(
        Shape(CHAT, vllm_legacy_chat, {**JSON, "Authorization": "Bearer None"}, False),
        id="vllm-legacy-chat",
    ),
]


def stream_events(
    http: httpx.Client, shape: Shape, body: dict[str, Any]
) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """Every event of the stream (read_sse: each `data: ` line a JSON object, `data: [DONE]`
    last and nothing after it)."""
    with http.stream("POST", shape.path, json=body, headers=shape.headers) as r:
        if r.status_code != 200:
            r.read()
            pytest.fail(f"{shape.path} answered {r.status_code}: {r.text}")
        assert r.headers["content-type"].startswith("text/event-stream")
        return r, read_sse(r)


def prompt_tokens(http: httpx.Client, shape: Shape, body: dict[str, Any]) -> int:
    if shape.chat:
        text = "".join(p["text"] for p in body["messages"][0]["content"])
        tok = {"messages": [{"role": "user", "content": text}]}
    else:
        tok = {"prompt": body["prompt"]}
    r = http.post("/tokenize", json=tok)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.parametrize("shape", SHAPES)
def test_client_shape_streams_to_the_end_with_usage(http, model_name, shape):
    body = shape.body(model_name)
    response, events = stream_events(http, shape, body)
    if "x-request-id" in shape.headers:
        assert response.headers["x-request-id"] == shape.headers["x-request-id"]

    assert events, "no event before data: [DONE]"
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    assert {e["object"] for e in events} == {obj}
    assert len({e["id"] for e in events}) == 1
    assert {e["model"] for e in events} == {model_name}

    # include_usage: exactly one usage chunk, the last, with no choices.
    *chunks, final = events
    assert final["choices"] == [], final
    usage = final["usage"]
    assert usage is not None and set(usage) >= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
    }
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == prompt_tokens(http, shape, body)
    assert usage["completion_tokens"] == MAX_TOKENS  # every shape sends ignore_eos

    # Every other chunk carries exactly one choice (n=1, index 0).
    assert chunks, "no chunk with a choice"
    assert all(len(e["choices"]) == 1 and e["choices"][0]["index"] == 0 for e in chunks)
    choices = [e["choices"][0] for e in chunks]
    if shape.chat:
        assert choices[0]["delta"].get("role") == "assistant"
        text = "".join(c["delta"].get("content") or "" for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    assert text, "no text arrived"
    assert choices[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])

    if shape.continuous_usage:
        # vLLM's continuous_usage_stats: the usage so far on every chunk, growing to the total.
        running = [e.get("usage") for e in chunks]
        assert all(u is not None for u in running), running
        assert all(u["prompt_tokens"] == usage["prompt_tokens"] for u in running)
        assert all(
            u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running
        )
        completion = [u["completion_tokens"] for u in running]
        assert completion == sorted(completion), completion
        assert running[-1] == usage
    else:
        assert all(e.get("usage") is None for e in chunks)


@pytest.mark.parametrize("shape", SHAPES)
def test_client_shape_with_an_undefined_field_is_refused(http, model_name, shape):
    """The shapes pass because every field in them is one OpenAI or vLLM defines, not
    because unknown fields are let through."""
    body = {**shape.body(model_name), "frobnicate": 1}
    r = http.post(shape.path, json=body, headers=shape.headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "frobnicate", r.json()


def test_continuous_usage_on_the_role_chunk_counts_no_completion_token(http, model_name):
    """vLLM (vllm/entrypoints/openai/chat_completion/serving.py @5e918640d7b6,
    chat_completion_stream_generator): the first chunk, `delta: {role, content: ""}`, carries
    `UsageInfo(prompt_tokens=n, completion_tokens=0, total_tokens=n)` under
    continuous_usage_stats; the chunks after it count the tokens they deliver."""
    body = GUIDELLM_CHAT.body(model_name)
    _, events = stream_events(http, GUIDELLM_CHAT, body)
    first = events[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    n = prompt_tokens(http, GUIDELLM_CHAT, body)
    usage = {k: first["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}
