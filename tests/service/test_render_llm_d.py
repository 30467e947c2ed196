"""llm-d's token producer (the precise prefix-cache scorer's tokenizer in
deploy/k8s/inference-pool/epp-config.yaml) renders through our vLLM render routes with the
bodies it builds in llm-d-inference-scheduler's
pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/vllm_http.go (at 520af47):
completions {model, prompt}, read as a list of {token_ids}; chat {model, messages (content a
string or a list of parts), add_generation_prompt and continue_final_message left out when
false, ...}, read as {token_ids}. Each must render to the ids the generation runs on."""

from __future__ import annotations

SYSTEM = {"role": "system", "content": "You are terse."}


def test_the_token_producers_completion_body_renders_the_prompts_ids(http, model_name):
    prompt = "The quick brown fox jumps over the lazy dog"
    rendered = http.post("/v1/completions/render", json={"model": model_name, "prompt": prompt})
    assert rendered.status_code == 200, rendered.text
    (first,) = rendered.json()
    tokenized = http.post("/tokenize", json={"model": model_name, "prompt": prompt}).json()
    assert first["token_ids"] == tokenized["tokens"] and tokenized["tokens"]


def test_the_token_producers_chat_bodies_render_as_the_chat_runs(http, model_name):
    parts = {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}
    text = {"role": "user", "content": "Name a colour."}
    body = {"model": model_name, "messages": [SYSTEM, parts], "add_generation_prompt": True}
    rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    chat = {"model": model_name, "messages": [SYSTEM, text], "max_tokens": 1, "temperature": 0}
    completion = http.post("/v1/chat/completions", json=chat).json()
    assert completion["usage"]["prompt_tokens"] == len(ids)
    tokenized = http.post("/tokenize", json={"model": model_name, "messages": [SYSTEM, text]})
    assert tokenized.json()["tokens"] == ids

    # add_generation_prompt false is left out of the body (omitempty): vLLM's default, true
    left_out = {"model": model_name, "messages": [SYSTEM, parts]}
    assert http.post("/v1/chat/completions/render", json=left_out).json()["token_ids"] == ids


def test_a_token_producer_naming_another_model_gets_a_404(http):
    body = {"model": "not-served", "prompt": "hello"}
    rendered = http.post("/v1/completions/render", json=body)
    assert rendered.status_code == 404 and rendered.json()["error"]["message"]
