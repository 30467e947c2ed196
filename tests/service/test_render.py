"""vLLM's render routes (/v1/chat/completions/render, /v1/completions/render): vLLM's
GenerateRequest for a generation body, its token ids the ones the generation runs on (the
same pipeline), nothing generated; and /tokenize taking the fields vLLM's router sends when
it tokenizes a chat there (continue_final_message)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_router_fields import ROUTER_CHAT, ROUTER_COMPLETION

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def _requests_total(http) -> float:
    text = http.get("/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "moeserve_requests_total"
    )


def test_chat_render_gives_the_ids_the_chat_completion_runs_on(http, model_name):
    body = {"model": model_name, "messages": HISTORY, "max_tokens": 3, "temperature": 0}
    before = _requests_total(http)
    rendered = http.post("/v1/chat/completions/render", json={**body, **ROUTER_CHAT})
    assert rendered.status_code == 200, rendered.text
    got = rendered.json()
    assert _requests_total(http) == before  # rendering generates nothing
    tokenized = http.post("/tokenize", json={"model": model_name, "messages": HISTORY}).json()
    assert got["token_ids"] == tokenized["tokens"]
    assert got["request_id"].startswith("chatcmpl-") and got["model"] == model_name
    assert got["features"] is None and got["stream"] is False and got["priority"] == 0
    params = got["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["n"]) == (3, 0.0, 1)
    assert "reasoning_end" not in params
    completion = http.post("/v1/chat/completions", json=body).json()
    assert completion["usage"]["prompt_tokens"] == len(got["token_ids"])


def test_chat_render_keeps_the_template_switches_and_stream_options(http):
    open_turn = [*HISTORY[:-1]]  # ends with the assistant's message, continued
    body = {
        "messages": open_turn,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["."],
        "max_tokens": 5,
    }
    got = http.post("/v1/chat/completions/render", json=body).json()
    tokenized = http.post(
        "/tokenize",
        json={
            "messages": open_turn,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    assert got["token_ids"] == tokenized["tokens"]
    closed = http.post("/tokenize", json={"messages": open_turn}).json()
    assert got["token_ids"] != closed["tokens"]  # the assistant's turn left open
    assert got["stream"] is True and got["stream_options"]["include_usage"] is True
    assert got["sampling_params"]["stop"] == ["."]


def test_completion_render_is_a_list_of_one_per_prompt(http, model_name):
    text = "The quick brown fox"
    body = {"model": model_name, "prompt": text, "max_tokens": 2, **ROUTER_COMPLETION}
    got = http.post("/v1/completions/render", json=body)
    assert got.status_code == 200, got.text
    [item] = got.json()
    assert item["request_id"].startswith("cmpl-")
    assert item["token_ids"] == http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    ids = [5, 6, 7, 8]
    [given] = http.post("/v1/completions/render", json={"prompt": ids}).json()
    assert given["token_ids"] == ids and given["sampling_params"]["max_tokens"] == 16


def test_render_refuses_what_the_generation_refuses(http):
    wrong_model = http.post("/v1/chat/completions/render", json={"model": "x", "messages": HISTORY})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["param"] == "model"
    unpaired = {"messages": HISTORY, "top_logprobs": 2}
    bad = http.post("/v1/chat/completions/render", json=unpaired)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    unknown = http.post("/v1/completions/render", json={"prompt": "hi", "beam": 2})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "beam"


def test_tokenize_takes_continue_final_message_only_with_messages(http):
    ok = http.post("/tokenize", json={"messages": HISTORY, "continue_final_message": False})
    assert ok.status_code == 200
    refused = http.post("/tokenize", json={"prompt": "hi", "continue_final_message": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "continue_final_message"


def test_the_openapi_document_states_the_render_routes(http):
    paths = http.get("/schema/openapi.json").json()["paths"]
    assert "/v1/chat/completions/render" in paths and "/v1/completions/render" in paths
