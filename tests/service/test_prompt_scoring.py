"""/v1/completions scoring its prompt (issue 39): `echo` (prompt text and prompt-token logprobs
first, the first one null), `max_tokens: 0` with echo, `logprobs: k` top ones at every
position, vLLM's `prompt_logprobs`; whole and streamed, n > 1, a prefix-cache hit; each
position against transformers' float32 log-softmax over the same prompt."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.inference.parity_checks import hf_model, prompts

COMP = "/v1/completions"


@pytest.fixture(scope="module")
def prompt(server) -> list[int]:
    return prompts(server.engine.args.vocab_size, [23])[0]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompt) -> torch.Tensor:
    """Row i: the log-softmax that scores prompt position i + 1."""
    with torch.inference_mode():
        logits = hf_model(tiny_model_dir)(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(-1)[:-1]


def text_of(server, ids: list[int]) -> list[str]:
    """Each token's text, as the API writes it."""
    return [server.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def check_prompt_part(server, logprobs: dict, prompt: list[int], reference, k: int) -> None:
    """The first len(prompt) entries of a choice's logprobs are the prompt's."""
    n = len(prompt)
    assert logprobs["tokens"][:n] == text_of(server, prompt)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for pos in range(1, n):
        row = reference[pos - 1]
        assert logprobs["token_logprobs"][pos] == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        top = logprobs["top_logprobs"][pos]
        assert len(top) == k
        assert sorted(top.values(), reverse=True) == pytest.approx(
            row.topk(k).values.tolist(), abs=1e-4
        )
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(
    http, server, model_name, prompt, reference
):
    body = {"model": model_name, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2}
    r = http.post(COMP, json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == server.engine.tokenizer.decode(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_prompt_part(server, choice["logprobs"], prompt, reference, 2)
    assert choice["finish_reason"] == "length" and "prompt_logprobs" not in choice
    usage = r.json()["usage"]
    assert usage == {"prompt_tokens": 23, "completion_tokens": 0, "total_tokens": 23}


def test_echo_leads_each_generated_choice(http, server, model_name, prompt, reference):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1), with n = 2."""
    body = {
        "model": model_name,
        "prompt": prompt,
        "echo": True,
        "max_tokens": 3,
        "logprobs": 1,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    r = http.post(COMP, json=body)
    assert r.status_code == 200, r.text
    echoed = server.engine.tokenizer.decode(prompt)
    for choice in r.json()["choices"]:
        assert choice["text"].startswith(echoed)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 3
        assert "".join(lp["tokens"]) == choice["text"]
        check_prompt_part(server, lp, prompt, reference, 1)
        assert all(v is not None for v in lp["token_logprobs"][len(prompt) :])
    assert r.json()["usage"]["completion_tokens"] == 6


def test_echo_streamed_gives_the_same_text_and_logprobs(http, server, model_name, prompt):
    body = {
        "model": model_name,
        "prompt": prompt,
        "echo": True,
        "max_tokens": 4,
        "logprobs": 1,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = http.post(COMP, json=body).json()["choices"][0]
    text, tokens, values, offsets = "", [], [], []
    with http.stream("POST", COMP, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                tokens += c["logprobs"]["tokens"]
                values += c["logprobs"]["token_logprobs"]
                offsets += c["logprobs"]["text_offset"]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert values == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)
    assert offsets == whole["logprobs"]["text_offset"]
    # scoring only, streamed: the prompt in one chunk that finishes with "length"
    body = {**body, "max_tokens": 0, "stream": True}
    with http.stream("POST", COMP, json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    [chunk] = chunks
    assert chunk["choices"][0]["text"] == server.engine.tokenizer.decode(prompt)
    assert chunk["choices"][0]["finish_reason"] == "length"


def test_vllm_prompt_logprobs_field(http, server, model_name, prompt, reference):
    body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    # twice: the second finds the prompt in the prefix cache and still scores every position
    for _ in range(2):
        r = http.post(COMP, json=body)
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        assert not choice["text"].startswith(server.engine.tokenizer.decode(prompt))
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(prompt) and scored[0] is None
        for pos in range(1, len(prompt)):
            row, token = reference[pos - 1], prompt[pos]
            entry = scored[pos][str(token)]
            assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry["rank"] == 1 + (row > row[token]).sum().item()
            assert [entry["decoded_token"]] == text_of(server, [token])
            best = row.topk(2).indices.tolist()
            assert {str(t) for t in best} <= set(scored[pos])
            assert [scored[pos][str(t)]["rank"] for t in best] == [1, 2]


def test_echo_of_a_text_prompt_with_a_structured_output(http, model_name):
    """The prompt as sent, then the constrained output."""
    body = {
        "model": model_name,
        "prompt": "Pick one:",
        "echo": True,
        "max_tokens": 8,
        "structured_outputs": {"regex": "[ab]{3}"},
    }
    r = http.post(COMP, json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith("Pick one:") and re.fullmatch("[ab]{3}", text[len("Pick one:") :])


def test_max_tokens_0_without_echo_is_a_400_naming_it(http, model_name):
    r = http.post(COMP, json={"model": model_name, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
