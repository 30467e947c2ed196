"""The fields vLLM's router (vllm-router 0.1.17) adds to every body it forwards, with their
meaning (issue 36): the bodies below are the ones it sends, captured off the wire. Served with
--reasoning-parser deepseek_r1 on the random tiny demo model, its text forced with a choice
constraint over the whole output (--structured-outputs-config enable_in_reasoning)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import pytest

from bench.harness import InProcessServer
from service.reasoning import ChoiceParse, ReasoningPlan
from tests.service.conftest import make_settings

USER = [{"role": "user", "content": "Which city is the capital of France?"}]
THOUGHT, ANSWER = "Weigh Paris against Rome.", "Paris"
CANNED = f"<think>{THOUGHT}</think>{ANSWER}"
# what vllm-router 0.1.17 adds to a chat and a completion body (its defaults)
ROUTER_CHAT = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


@pytest.fixture(scope="module")
def srv(tiny_model_dir) -> Iterator[InProcessServer]:
    settings = make_settings(
        tiny_model_dir,
        reasoning_parser="deepseek_r1",
        structured_outputs_config='{"enable_in_reasoning": true}',
    )
    with InProcessServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def http(srv) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def _chat(**more) -> dict:
    forced = {"structured_outputs": {"choice": [CANNED]}}
    return {"messages": USER, "max_tokens": 60, **ROUTER_CHAT, **forced, **more}


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [msgspec.json.decode(line) for line in lines if line != "[DONE]"]


def _stream_parts(response: httpx.Response) -> tuple[list[str], str]:
    reasoning, content = [], ""
    for event in _events(response):
        for choice in event["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            content += delta.get("content") or ""
    return reasoning, content


def test_the_routers_chat_body_is_served_whole_and_streamed(http):
    response = http.post("/v1/chat/completions", json=_chat())
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    streamed = http.post("/v1/chat/completions", json=_chat(stream=True))
    assert streamed.status_code == 200, streamed.text
    reasoning, content = _stream_parts(streamed)
    assert ("".join(reasoning), content) == (THOUGHT, ANSWER)


def test_the_routers_completion_body_is_served_whole_and_streamed(http):
    body = {"prompt": "The capital of France is", "max_tokens": 4, **ROUTER_COMPLETION}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    assert sum(len(e["choices"]) for e in _events(streamed)) >= 1


def test_include_reasoning_false_drops_the_reasoning(http):
    response = http.post("/v1/chat/completions", json=_chat(include_reasoning=False))
    message = response.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None
    assert message["content"] == ANSWER
    reasoning, content = _stream_parts(
        http.post("/v1/chat/completions", json=_chat(include_reasoning=False, stream=True))
    )
    assert (reasoning, content) == ([], ANSWER)


def test_separate_reasoning_false_leaves_it_in_the_content(http):
    response = http.post("/v1/chat/completions", json=_chat(separate_reasoning=False))
    message = response.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None
    assert message["content"] == CANNED


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta(http):
    reasoning, content = _stream_parts(
        http.post("/v1/chat/completions", json=_chat(stream_reasoning=False, stream=True))
    )
    assert (reasoning, content) == ([THOUGHT], ANSWER)
    streamed, _ = _stream_parts(http.post("/v1/chat/completions", json=_chat(stream=True)))
    assert len(streamed) > 1  # the default streams it token by token


@pytest.mark.parametrize("field", ["no_stop_trim", "return_hidden_states"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_feature_we_lack_asked_for_is_a_400_naming_it(http, path, field):
    body = _chat() if path.endswith("chat/completions") else {"prompt": "Hi", "max_tokens": 2}
    response = http.post(path, json={**body, field: True})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_continue_final_message_continues_the_assistants_message(http, srv):
    tokenizer = srv.state.engine.tokenizer
    messages = [*USER, {"role": "assistant", "content": "The capital is"}]
    expected = tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert expected.rstrip().endswith("The capital is")
    body = {"messages": messages, "max_tokens": 2, "separate_reasoning": False}
    response = http.post(
        "/v1/chat/completions",
        json={**body, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert response.status_code == 200, response.text
    ids = tokenizer.encode(expected, add_special_tokens=False)
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    # vLLM's rules: not with a new turn opened, and only an assistant's message goes on
    for wrong in (
        {**body, "continue_final_message": True},
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
    ):
        refused = http.post("/v1/chat/completions", json=wrong)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "continue_final_message"


def test_kept_special_tokens_are_dropped_from_what_the_parsers_hand_on():
    """skip_special_tokens true under a parser: the engine keeps the markers for the parser,
    the render removes the special tokens from reasoning and content."""
    parse = ChoiceParse(ReasoningPlan("deepseek_r1"), None, ("<|im_end|>",))
    assert parse.whole("<think>a<|im_end|>b</think>c<|im_end|>") == ("ab", "c", [])


def test_the_openapi_document_states_the_fields(http):
    schemas = http.get("/schema/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    for field in ROUTER_CHAT:
        assert field in chat, field
    for field in ROUTER_COMPLETION:
        assert field in completion, field
    assert chat["no_stop_trim"]["enum"] == [None, False]
    assert "reasoning" in chat["include_reasoning"]["description"]
