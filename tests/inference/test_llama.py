"""Dense LlamaForCausalLM on our engine against transformers' own implementation, token for
token (float32): random small configs, alone and in a mixed continuous batch, and a GGUF
checkpoint imported to a Hugging Face folder."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference import LLMEngine, SamplingParams
from inference.attention import AttentionMetadata, PrefillChunk
from inference.demo_model import CHAT_TEMPLATE
from inference.gguf_import import import_gguf

try:
    from tests.inference.tiny_gguf import random_llama, write_gguf
except ImportError:  # tests/ is not a package
    from tiny_gguf import random_llama, write_gguf  # type: ignore[no-redef]

# min_tokens: transformers' min_new_tokens masks the EOS ids, so the engine must too
GREEDY_32 = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, ignore_eos=True)
CONFIGS = {
    "llama": {},
    # SmolLM2-like tied embeddings; Llama-3 rope scaling (original 64 positions, so most
    # frequencies are rescaled); q/k/v/o and MLP biases; one KV head; heads*dim != hidden.
    "llama_tied_llama3_bias": {
        "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
        "num_key_value_heads": 1, "head_dim": 32,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}},
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


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_logits_match(llama_dirs, name):
    path = llama_dirs(name)
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=512)
    assert engine.args.num_experts == 0 and len(engine.args.dense_layers) == engine.args.num_layers
    ref = hf_model(path)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    model, caches = engine.model, engine.kv_caches
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(20), 0, None, None, [PrefillChunk(0, 20, 0, None)])
        hidden, counts = model(torch.tensor(tokens[:20]), torch.arange(20), meta, caches)
        expected = ref(torch.tensor([tokens[:20]])).logits[0]
        torch.testing.assert_close(model.logits(hidden), expected, atol=1e-4, rtol=1e-4)
        assert counts.numel() == 0  # no MoE layer, no router counts
        for pos in range(20, 24):  # decode steps, one token each, reading the paged cache
            meta = AttentionMetadata(torch.tensor([pos]), 1, torch.arange(pos + 1)[None],
                                     torch.ones(1, 1, 1, pos + 1, dtype=torch.bool), [])
            hidden, _ = model(torch.tensor([tokens[pos]]), torch.tensor([pos]), meta, caches)
            expected = ref(torch.tensor([tokens[: pos + 1]])).logits[0, -1]
            torch.testing.assert_close(model.logits(hidden)[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_alone_matches_generate(llama_dirs, name):
    path = llama_dirs(name)
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=1024)
    ref = hf_model(path)
    for prompt in prompts(engine.args.vocab_size, [7, 40]):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(ref, prompt)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("name", CONFIGS)
def test_continuous_batch_with_chunked_prefill_and_preemption(llama_dirs, name):
    """Mixed prompt lengths, a 24-token step budget (prefills are chunked) and a KV cache of
    12 blocks of 16 tokens, far below what the batch needs, so sequences get preempted."""
    path = llama_dirs(name)
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=192,
                                       max_num_batched_tokens=24, max_num_seqs=8)
    ref = hf_model(path)
    batch = prompts(engine.args.vocab_size, [5, 61, 17, 33, 9, 48])
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch):
        engine.add_request(rid, prompt, GREEDY_32)
    final, preemptions, chunked = {}, 0, False
    while engine.has_unfinished:
        outputs, stats = engine.step()
        preemptions += stats.num_preemptions
        chunked |= 0 < stats.num_prefill_tokens and stats.num_prefill_tokens + stats.num_decode_tokens == 24
        final.update({o.request_id: o for o in outputs if o.finished})
    assert preemptions > 0 and chunked
    for rid, prompt in zip(ids, batch):
        assert final[rid].token_ids == hf_greedy(ref, prompt), rid
    assert engine.block_manager.num_used == 0


def test_imported_gguf_generates_like_transformers(llama_dirs, model_dirs, tmp_path):
    """GGUF (Q8_0) -> import_gguf -> a folder both our engine and transformers serve alike."""
    tok_dir = model_dirs("mixtral")
    gguf = tmp_path / "tiny.gguf"
    write_gguf(random_llama(tok_dir, seed=2), tok_dir, gguf, CHAT_TEMPLATE)
    path = import_gguf(gguf, tmp_path / "imported")
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=512)
    ref = hf_model(path)
    for prompt in prompts(engine.args.vocab_size, [9, 30]):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(ref, prompt)
    messages = [{"role": "user", "content": "hello"}]
    assert engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) \
        .endswith("<|im_start|>assistant\n")
