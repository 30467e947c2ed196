"""Dense LlamaForCausalLM on our engine against transformers' own implementation, token for
token (float32): random small configs, alone and in a mixed continuous batch, and a GGUF
checkpoint imported to a Hugging Face folder."""

from __future__ import annotations

import shutil

import pytest

from inference import LLMEngine
from inference.checkpoints.demo_model import CHAT_TEMPLATE
from inference.checkpoints.gguf_import import import_gguf
from tests.inference.parity_checks import (
    DEVICE,
    GREEDY_32,
    check_continuous_batch_with_chunked_prefill_and_preemption,
    check_greedy_alone_matches_generate,
    check_logits_match,
    hf_greedy,
    hf_model,
    prompts,
)
from tests.inference.tiny_gguf import random_llama, write_gguf

CONFIGS = {
    "llama": {},
    # SmolLM2-like tied embeddings; Llama-3 rope scaling (original 64 positions, so most
    # frequencies are rescaled); q/k/v/o and MLP biases; one KV head; heads*dim != hidden.
    "llama_tied_llama3_bias": {
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def llama_dirs(model_dirs, tmp_path_factory):
    """config name -> folder of a random float32 Llama checkpoint with the demo tokenizer."""
    tok_dir = model_dirs("mixtral")
    root = tmp_path_factory.mktemp("llama")
    cache = {}

    def get(name: str):
        if name not in cache:
            path = root / name
            random_llama(tok_dir, seed=1, **CONFIGS[name]).save_pretrained(path)
            for f in TOKENIZER_FILES:
                shutil.copy(tok_dir / f, path / f)
            cache[name] = path
        return cache[name]

    return get


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_logits_match(llama_dirs, name):
    check_logits_match(llama_dirs(name))


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_alone_matches_generate(llama_dirs, name):
    check_greedy_alone_matches_generate(llama_dirs(name))


@pytest.mark.parametrize("name", CONFIGS)
def test_continuous_batch_with_chunked_prefill_and_preemption(llama_dirs, name):
    check_continuous_batch_with_chunked_prefill_and_preemption(llama_dirs(name))


def test_imported_gguf_generates_like_transformers(llama_dirs, model_dirs, tmp_path):
    """GGUF (Q8_0) -> import_gguf -> a folder both our engine and transformers serve alike."""
    tok_dir = model_dirs("mixtral")
    gguf = tmp_path / "tiny.gguf"
    write_gguf(random_llama(tok_dir, seed=2), tok_dir, gguf, CHAT_TEMPLATE)
    path = import_gguf(gguf, tmp_path / "imported")
    engine = LLMEngine.from_pretrained(path, device=DEVICE, dtype="float32", kv_cache_tokens=512)
    ref = hf_model(path, DEVICE)
    for prompt in prompts(engine.args.vocab_size, [9, 30]):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(ref, prompt)
    messages = [{"role": "user", "content": "hello"}]
    assert engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")
