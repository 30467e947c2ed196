"""lm-evaluation-harness, unmodified, against the served tiny model (issue 39): its
`local-completions` model over the local task pack (bench/eval_pack.py: a multiple-choice
cloze by loglikelihood, a rolling perplexity, a generate_until task with a regex-checked
answer), next to its `hf` model on the same float32 checkpoint through transformers. Every
document's scores agree: loglikelihoods within float32 rounding, the same choices, the same
generated text, perplexities within 0.1%. Its `local-chat-completions` model generates the
same text through the chat template as the hf model with apply_chat_template. Nothing
reaches a hub (HF_*_OFFLINE)."""

from __future__ import annotations

import os

import pytest

from bench.eval_pack import TASKS, write_pack

# local-completions' max_length (the server's context is 256); its rolling windows score
# max_length - 2 tokens after one of context (it keeps one token for generation), the `hf`
# model's max_length tokens: the hf run gets max_length - 2, so both score the same windows
MAX_LENGTH = 128

# no hub at run time: read when datasets and huggingface_hub are first imported
for _name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")


def evaluate(model: str, model_args: dict, include_path, tasks=TASKS, **more) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(include_path)),
        log_samples=True,
        batch_size=1,
        **more,
    )


def by_doc(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_its_hf_model_does(server, tiny_model_dir, tmp_path):
    pack = write_pack(tmp_path / "pack")
    ours = evaluate(
        "local-completions",
        {
            "model": server.state.model_name,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": str(tiny_model_dir),
            "tokenizer_backend": "huggingface",
            "max_length": MAX_LENGTH,
            "max_retries": 1,
        },
        pack,
    )
    hf = evaluate(
        "hf",
        {
            "pretrained": str(tiny_model_dir),
            "dtype": "float32",
            "device": "cpu",
            "max_length": MAX_LENGTH - 2,
        },
        pack,
    )
    assert len(ours["samples"]["stdlib_cloze"]) == 50
    # per document: each choice's loglikelihood, whether it is greedy
    for got, want in zip(by_doc(ours, "stdlib_cloze"), by_doc(hf, "stdlib_cloze"), strict=True):
        assert [c[0][0] for c in got] == pytest.approx([c[0][0] for c in want], abs=2e-3)
    cloze = "acc,none"
    assert ours["results"]["stdlib_cloze"][cloze] == hf["results"]["stdlib_cloze"][cloze]
    for got, want in zip(
        by_doc(ours, "stdlib_perplexity"), by_doc(hf, "stdlib_perplexity"), strict=True
    ):
        assert got[0][0] == pytest.approx(want[0][0], rel=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = (
            ours["results"]["stdlib_perplexity"][metric],
            hf["results"]["stdlib_perplexity"][metric],
        )
        assert got == pytest.approx(want, rel=1e-3), metric
    # the same text (a character cut off at the end aside)
    generated = unfinished_character_dropped(hf, "stdlib_generate")
    assert by_doc(ours, "stdlib_generate") == generated
    match = "exact_match,first_identifier"
    assert ours["results"]["stdlib_generate"][match] == hf["results"]["stdlib_generate"][match]


def unfinished_character_dropped(result: dict, task: str) -> list:
    """transformers' decode of a whole output ends a character cut off by max_gen_toks with
    U+FFFD; the server's detokenizer holds its bytes back (as streaming needs)."""
    return [[[r[0].rstrip("\ufffd")] for r in doc] for doc in by_doc(result, task)]


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generates_as_its_hf_model_does(
    server, tiny_model_dir, tmp_path
):
    """The generative task through the chat template: /v1/chat/completions against the hf
    model with lm-eval's apply_chat_template."""
    pack = write_pack(tmp_path / "pack")
    tasks = ["stdlib_generate"]
    ours = evaluate(
        "local-chat-completions",
        {"model": server.state.model_name, "base_url": f"{server.url}/v1/chat/completions"},
        pack,
        tasks,
        apply_chat_template=True,
    )
    hf = evaluate(
        "hf",
        {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        pack,
        tasks,
        apply_chat_template=True,
    )
    generated = by_doc(ours, "stdlib_generate")
    assert len(generated) == 12 and sum(bool(doc[0][0]) for doc in generated) >= 6
    assert generated == unfinished_character_dropped(hf, "stdlib_generate")


@pytest.mark.slow
def test_quant_bench_perplexity_is_lm_evals_rolling_perplexity(server, tiny_model_dir, tmp_path):
    """The same text, the same windows: bench/quant_bench.py's perplexity (the engine's prompt
    logprobs over rolling_windows) and lm-eval's loglikelihood_rolling through the served
    model's API (local-completions at the max_length giving those windows), per document."""
    import math

    from bench.quant_bench import CHUNK, perplexity, prefix_token
    from inference import LLMEngine

    ours = evaluate(
        "local-completions",
        {
            "model": server.state.model_name,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": str(tiny_model_dir),
            "tokenizer_backend": "huggingface",
            "max_length": MAX_LENGTH,
            "max_retries": 1,
        },
        write_pack(tmp_path / "pack"),
        ["stdlib_perplexity"],
    )
    engine = LLMEngine.from_pretrained(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=CHUNK,
        kv_cache_tokens=4096,
        enable_prefix_caching=False,
    )
    samples = sorted(ours["samples"]["stdlib_perplexity"], key=lambda s: s["doc_id"])
    assert len(samples) == 4
    for sample in samples:
        [text] = sample["arguments"][0]  # the string lm-eval scored
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) > 2 * MAX_LENGTH  # several windows, the last a short one
        served = math.exp(-sample["resps"][0][0] / len(ids))
        bench = perplexity(engine, ids, prefix_token(engine.tokenizer), scored=MAX_LENGTH - 2)
        assert bench == pytest.approx(served, rel=1e-4)
