"""The served OpenAPI document tells the truth. Its shape is checked directly; then
schemathesis, every check on, positive and negative generation, with the API key set, finds
nothing (bounded: under 2 minutes).

Schema-valid requests must be accepted and schema-invalid ones get a 4xx; responses match
their documented status, content type, headers and schema. The one rule JSON Schema cannot
state (prompt tokens + max_tokens fit the context) is left out of generation by
schemathesis_hooks.py, which measures prompts with the server's own /tokenize.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
KEY = "sk-fuzz"
MAX_EXAMPLES = 20


@pytest.mark.slow
def test_schemathesis_finds_nothing(start_server, tmp_path):
    # per-request metrics on, so `include_metrics: true` is schema-valid and accepted, and
    # the `metrics` objects it adds to responses are checked against the document too
    with start_server(api_key=KEY, enable_per_request_metrics=True) as srv:
        env = dict(
            os.environ,
            PYTHONPATH=str(HERE),
            SCHEMATHESIS_HOOKS="schemathesis_hooks",
            MOESERVE_FUZZ_URL=srv.url,
            MOESERVE_FUZZ_KEY=KEY,
            MOESERVE_FUZZ_MAX_MODEL_LEN=str(srv.engine.max_model_len),
            MOESERVE_FUZZ_VOCAB_SIZE=str(srv.engine.args.vocab_size),
        )
        auth = {"authorization": f"Bearer {KEY}"}
        document = httpx.get(f"{srv.url}/schema/openapi.json", headers=auth).json()
        operations = len(_operations(document))
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("st")),
                "run",
                f"{srv.url}/schema/openapi.json",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--checks",
                "all",
                "--mode",
                "all",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                "0",  # the same cases on every run; vary it by hand to explore
                "--request-timeout",
                "30",
                "--no-color",
            ],
            env=env,
            check=False,
            cwd=tmp_path,  # schemathesis writes its example database here
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    # every operation tested (schemathesis 4 words it "Selected: N/N", earlier "N selected /
    # N total")
    every = (f"Selected: {operations}/{operations}", f"{operations} selected / {operations} total")
    assert any(line in run.stdout for line in every), run.stdout[-3000:]


def _operations(document: dict) -> dict[str, dict]:
    return {op["operationId"]: op for path in document["paths"].values() for op in path.values()}


def test_every_operation_documents_its_errors_in_the_envelope(http):
    document = http.get("/schema/openapi.json").json()
    ops = _operations(document)
    wanted = {
        "createCompletion": {"400", "401", "404", "413", "429", "503"},
        "createChatCompletion": {"400", "401", "404", "413", "429", "503"},
        "tokenize": {"400", "401", "404", "413", "503"},
        "detokenize": {"400", "401", "404", "413", "503"},
        "listModels": {"401", "503"},
    }
    for name, statuses in wanted.items():
        responses = ops[name]["responses"]
        assert statuses <= set(responses), (name, set(responses))
        for status in statuses:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (name, status)
    for name in ("createCompletion", "createChatCompletion"):  # JSON or SSE
        assert set(ops[name]["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }
    assert set(ops["ready"]["responses"]) == {"200", "503"}


def test_request_schemas_carry_the_servers_rules(http, server):
    schemas = http.get("/schema/openapi.json").json()["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False
    assert completion["properties"]["prompt"]["anyOf"][0] == {"type": "string", "minLength": 1}
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert schemas["TokenId"]["maximum"] == server.engine.args.vocab_size - 1
    max_tokens = completion["properties"]["max_tokens"]["anyOf"][0]  # 0: with echo
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (0, server.engine.max_model_len - 1)
    chat_max = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert (chat_max["minimum"], chat_max["maximum"]) == (1, server.engine.max_model_len - 1)
    top_p = completion["properties"]["top_p"]["anyOf"][0]
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, 1.0)
    assert completion["properties"]["echo"]["type"] == "boolean"
    assert completion["properties"]["suffix"]["enum"] == [None, ""]
    assert "oneOf" in schemas["TokenizeRequest"]  # exactly one of prompt and messages


def test_bearer_auth_is_documented_only_when_a_key_is_set(http, api_key):
    document = http.get("/schema/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    ops = _operations(document)
    assert ops["createCompletion"]["security"] == [{"bearer": []}]
    assert "security" not in ops["health"]


def test_no_security_without_a_key(http):
    document = http.get("/schema/openapi.json").json()
    assert "securitySchemes" not in document.get("components", {})
