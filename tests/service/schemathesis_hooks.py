"""Schemathesis hooks for test_service_openapi.py. JSON Schema cannot state that prompt
tokens + max_tokens fit in the context, or that min_tokens <= max_tokens (the document says
both in words); a schema-valid generated request that breaks them is brought inside before it
is sent (every phase calls this hook; generation filters do not run in the coverage phase):
the prompt is cut (measured by the server's own /tokenize), max_tokens and min_tokens capped.
Nor can it state that logit_bias keys are token ids below the vocabulary size (they are
taken modulo it), or which strings a regex, grammar or JSON Schema compiler takes: generated
ones are replaced by ones that compile (their refusal is tested in test_service_structured.py),
tools keep distinct names, a named tool_choice names one of them and a forcing tool_choice
comes without another constraint; a completion's max_tokens 0 comes with echo and its
prompt_logprobs unstreamed, and continue_final_message comes with an assistant's last
message and without add_generation_prompt (the document says these in words). Generations are also capped at GENERATE tokens, so that
the run stays short on 2 cores."""

from __future__ import annotations

import os

import httpx
import schemathesis

URL, KEY = os.environ["MOESERVE_FUZZ_URL"], os.environ["MOESERVE_FUZZ_KEY"]
MAX_MODEL_LEN = int(os.environ["MOESERVE_FUZZ_MAX_MODEL_LEN"])
VOCAB_SIZE = int(os.environ["MOESERVE_FUZZ_VOCAB_SIZE"])
GENERATE = 4


def _prompt_tokens(body: dict) -> int | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return len(prompt)
    query = {"prompt": prompt} if isinstance(prompt, str) else {"messages": body.get("messages")}
    if body.get("tools") and body.get("tool_choice") != "none":  # rendered with the messages
        query["tools"] = body["tools"]
    r = httpx.post(f"{URL}/tokenize", json=query, headers={"authorization": f"Bearer {KEY}"})
    return r.json()["count"] if r.status_code == 200 else None


def _int(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value)


def _constraints_inside(body: dict) -> None:
    bias = body.get("logit_bias")
    if isinstance(bias, dict):  # token ids below the vocabulary size (the document says so)
        body["logit_bias"] = {str(int(k) % VOCAB_SIZE): v for k, v in bias.items()}
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        fixes = {"json": {"type": "object"}, "regex": "[ab]{1,3}", "grammar": 'start: "a"'}
        for key, valid in fixes.items():
            if so.get(key) is not None:
                so[key] = valid
    rf = body.get("response_format")
    schema = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(schema, dict) and schema.get("schema") is not None:
        schema["schema"] = {"type": "object"}
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict):
                function["name"] = f"f{i}"
                if function.get("parameters") is not None:
                    function["parameters"] = {"type": "object"}
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            choice["function"]["name"] = "f0"
        if choice not in (None, "none", "auto"):
            body.pop("response_format", None)
            body.pop("structured_outputs", None)
    if body.get("response_format") not in (None, {"type": "text"}):
        body.pop("structured_outputs", None)
    if "prompt" in body:  # completions: max_tokens 0 only with echo, prompt_logprobs not streamed
        if _int(body.get("max_tokens")) and body["max_tokens"] == 0:
            body["echo"] = True
        if body.get("stream") is True:
            body.pop("prompt_logprobs", None)


@schemathesis.hook
def before_call(ctx, case, kwargs) -> None:
    body = case.body
    path = case.operation.path.removesuffix("/render")  # vLLM's render: the same bodies
    if not isinstance(body, dict) or case.meta is None or not case.meta.generation.mode.is_positive:
        return
    if body.get("continue_final_message") is True:  # the assistant's last message left open
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            body["continue_final_message"] = False  # nothing to continue (or /tokenize's prompt)
        else:
            body["add_generation_prompt"] = False  # no new turn
    if not path.endswith("completions"):
        return
    _constraints_inside(body)
    count = _prompt_tokens(body)
    if count is not None and count >= MAX_MODEL_LEN - GENERATE:  # keep the last message
        if isinstance(body.get("messages"), list):
            body["messages"] = body["messages"][-1:]
            if body.pop("tools", None) is not None:  # a forcing tool_choice would need them
                body.pop("tool_choice", None)
        elif isinstance(body.get("prompt"), (str, list)):
            body["prompt"] = body["prompt"][: MAX_MODEL_LEN // 8]
        count = _prompt_tokens(body)
    if count is None or count >= MAX_MODEL_LEN - GENERATE:
        return
    room = GENERATE
    chat = path.endswith("chat/completions")
    keys = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    for key in keys:
        if _int(body.get(key)) and body[key] > room:
            body[key] = room
    given = next((body[k] for k in reversed(keys) if _int(body.get(k))), None)
    max_tokens = given if given is not None else room if chat else 16
    if chat and given is None:
        body["max_completion_tokens"] = max_tokens = room
    if _int(body.get("min_tokens")) and body["min_tokens"] > max_tokens:
        body["min_tokens"] = max_tokens
