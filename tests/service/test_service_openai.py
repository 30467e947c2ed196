"""The OpenAI-compatible API through the official `openai` client, plus tokenizer and probes."""

from __future__ import annotations

import openai
import pytest

from bench.harness import read_sse

PROMPT = "def fibonacci(n):"


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as c:
        yield c


def test_completion_returns_text_usage_and_finish_reason(client, model_name):
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0
    )
    assert raw.headers.get("x-request-id")
    resp = raw.parse()
    assert (
        resp.object == "text_completion"
        and resp.model == model_name
        and resp.id.startswith("cmpl-")
    )
    (choice,) = resp.choices
    assert choice.index == 0 and isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= resp.usage.completion_tokens <= 6 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_accepts_token_ids_as_prompt(client, model_name, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, temperature=0
    )
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seed_reproduces_sampled_output(client, model_name):
    def sample(seed):
        return (
            client.completions.create(
                model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3)), (
        "different seeds should change the sample"
    )


def test_n_returns_one_choice_per_index(client, model_name):
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=1.0, n=2, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens <= 8 and resp.usage.completion_tokens >= 2
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=7
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string_cuts_the_output(client, model_name):
    full = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, model_name):
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    )
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_completion_and_logprobs(client, model_name):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_content_parts_equal_plain_content(client, model_name):
    plain = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
    )
    parts = client.chat.completions.create(
        model=model_name,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
            }
        ],
        max_tokens=4,
        temperature=0,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_completion_matches_non_streamed(client, model_name):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_with_n_and_usage(client, model_name):
    kwargs = {
        "model": model_name,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
    }
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    texts, roles, finishes, usage = {0: "", 1: ""}, {}, {}, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_without_usage_ends_with_done(http, model_name):
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get("x-request-id")
        events = read_sse(r)  # data: {json} events, then data: [DONE]
    assert len(events) >= 1
    assert "usage" in events[-1] and events[-1]["usage"] is None


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.state.model_name]
    assert models[0].object == "model"


def test_tokenize_and_detokenize_round_trip(http, server):
    r = http.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200
    body = r.json()
    assert (
        body["count"] == len(body["tokens"]) > 0
        and body["max_model_len"] == server.engine.max_model_len
    )
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {
        "prompt": "hello world"
    }
    chat = http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "hello world"}]}
    ).json()
    assert chat["count"] > body["count"]  # the template adds role markers


def test_probes(http, server):
    assert http.get("/health").json() == {"status": "ok", "engine_alive": True}
    r = http.get("/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["model"] == server.state.model_name and r.json()["kv_blocks_used"] == 0


def test_request_id_is_honoured_or_generated(http):
    assert (
        http.get("/health", headers={"x-request-id": "trace-1.2:3"}).headers["x-request-id"]
        == "trace-1.2:3"
    )
    generated = http.get("/health", headers={"x-request-id": "bad id with spaces"}).headers[
        "x-request-id"
    ]
    assert generated != "bad id with spaces" and len(generated) == 32
    a, b = http.get("/nope").headers["x-request-id"], http.get("/nope").headers["x-request-id"]
    assert a != b


def test_openapi_schema_is_served(http):
    schema = http.get("/schema/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/v1/completions" in schema["paths"]
