"""EvalScope (ModelScope's evaluation framework), unmodified, against the served tiny model
(issue 39): its `evalscope eval` command with the OpenAI-API backend (the chat API) over the
local pack's cloze items as its general_mcq custom dataset (bench/evalscope_run.py), next to
its own transformers backend (llm_ckpt) on the same float32 checkpoint. Every item is
answered through the API, with the text transformers generates, and the same accuracy.
Nothing reaches a hub (HF_*_OFFLINE; the data is local, the checkpoint a folder)."""

from __future__ import annotations

import pytest

from bench.eval_pack import write_evalscope_pack
from bench.evalscope_run import checkpoint_args, run_evalscope, served_args

ITEMS = 12


@pytest.mark.slow
def test_evalscope_openai_api_answers_as_its_transformers_backend(
    start_server, tiny_model_dir, tmp_path
):
    data = write_evalscope_pack(tmp_path / "data", limit=ITEMS)
    # EvalScope's multiple-choice prompt (its template and four choices) is ~290 tokens
    with start_server(max_model_len=512) as server:
        args = served_args(server.state.model_name, f"{server.url}/v1")
        served = run_evalscope(tmp_path / "api", data, args)
        assert len(server.finished) == ITEMS  # every item one chat request to this server
    reference = run_evalscope(tmp_path / "hf", data, checkpoint_args(tiny_model_dir))
    assert sorted(served["answers"]) == list(range(ITEMS))
    # transformers' decode ends an answer cut off mid-character with U+FFFD; the server's
    # detokenizer holds those bytes back (as streaming needs)
    want = {i: text.rstrip("\ufffd") for i, text in reference["answers"].items()}
    assert served["answers"] == want
    assert served["accuracy"] == reference["accuracy"]
