"""Reasoning output over REST through the official `openai` client: `reasoning_content` apart
from `content`, whole and streamed (--reasoning-parser deepseek_r1 on the random tiny demo
model, its text forced with a choice constraint, which constrains the reasoning too with
vLLM's --structured-outputs-config '{"enable_in_reasoning": true}'); by default a grammar
leaves the reasoning alone."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from bench.harness import InProcessServer
from tests.service.conftest import make_settings

USER = [{"role": "user", "content": "Which city is the capital of France?"}]
THOUGHT, ANSWER = "Weigh Paris against Rome.", "Paris"
CANNED = f"<think>{THOUGHT}</think>{ANSWER}"
IN_REASONING = '{"enable_in_reasoning": true}'


@pytest.fixture(scope="module")
def srv(tiny_model_dir) -> Iterator[InProcessServer]:
    settings = make_settings(tiny_model_dir, reasoning_parser="deepseek_r1")
    with InProcessServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def in_reasoning(srv) -> Iterator[None]:
    """--structured-outputs-config for one test (requests read the live settings)."""
    settings = srv.state.settings
    saved, settings.structured_outputs_config = settings.structured_outputs_config, IN_REASONING
    try:
        yield
    finally:
        settings.structured_outputs_config = saved


def _body(srv, **more) -> dict:
    return {"model": srv.state.model_name, "messages": USER, "max_tokens": 60, **more}


def _streamed(stream) -> tuple[str, str, list, str | None]:
    reasoning, content, chunks, finish = "", "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            r, c = getattr(delta, "reasoning_content", None), delta.content
            chunks.append((r, c))
            reasoning += r or ""
            content += c or ""
            finish = choice.finish_reason or finish
    return reasoning, content, chunks, finish


def test_reasoning_content_arrives_apart_from_content(srv, client, in_reasoning):
    body = _body(srv, extra_body={"structured_outputs": {"choice": [CANNED]}})
    message = client.chat.completions.create(**body).choices[0].message
    assert message.reasoning_content == THOUGHT
    assert message.content == ANSWER
    reasoning, content, chunks, finish = _streamed(
        client.chat.completions.create(**body, stream=True)
    )
    assert (reasoning, content, finish) == (THOUGHT, ANSWER, "stop")
    # no chunk mixes the two here, and no marker leaks into either
    assert all(not (r and c) for r, c in chunks)
    assert all("think>" not in (r or "") + (c or "") for r, c in chunks)


def test_without_reasoning_there_is_no_reasoning_content(srv, client, in_reasoning):
    """</think> first: all answer; the field is absent, as vLLM leaves it null."""
    body = _body(srv, extra_body={"structured_outputs": {"choice": [f"</think>{ANSWER}"]}})
    response = client.chat.completions.create(**body)
    message = response.choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None
    assert (
        "reasoning_content" not in response.model_dump(exclude_unset=True)["choices"][0]["message"]
    )
    reasoning, content, _, _ = _streamed(client.chat.completions.create(**body, stream=True))
    assert (reasoning, content) == ("", ANSWER)


def test_a_grammar_constrains_the_answer_not_the_reasoning(srv, client):
    """By default the grammar waits for </think>: the random model never writes it, so its
    greedy output is all reasoning and the same with the grammar as without."""
    greedy = _body(srv, temperature=0, max_tokens=12)
    free = client.chat.completions.create(**greedy).choices[0].message
    forced = (
        client.chat.completions.create(
            **greedy, extra_body={"structured_outputs": {"choice": [ANSWER]}}
        )
        .choices[0]
        .message
    )
    assert free.content is None and free.reasoning_content
    assert (forced.reasoning_content, forced.content) == (free.reasoning_content, None)


def test_reasoning_parser_none_leaves_the_text_as_content(srv, client):
    settings = srv.state.settings
    greedy = _body(srv, temperature=0, max_tokens=12)
    reasoned = client.chat.completions.create(**greedy).choices[0].message
    settings.reasoning_parser = "none"
    try:
        plain = client.chat.completions.create(**greedy).choices[0].message
    finally:
        settings.reasoning_parser = "deepseek_r1"
    assert plain.content == reasoned.reasoning_content
    assert getattr(plain, "reasoning_content", None) is None
