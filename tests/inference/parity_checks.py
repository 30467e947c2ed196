"""Parity checks of our engine against transformers (float32), shared by the architecture
tests: prefill/decode logits, greedy decoding alone, and greedy decoding inside a continuous
batch with chunked prefill and forced preemption."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from inference import LLMEngine, SamplingParams
from inference.attention import AttentionMetadata, PrefillChunk

# min_tokens: transformers' min_new_tokens masks the EOS ids, so the engine must too
GREEDY_32 = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, ignore_eos=True)


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def check_logits_match(path) -> None:
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=512)
    ref = hf_model(path)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    model, caches = engine.model, engine.kv_caches
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(20), 0, None, None, [PrefillChunk(0, 20, 0, None)])
        hidden, counts = model(torch.tensor(tokens[:20]), torch.arange(20), meta, caches)
        expected = ref(torch.tensor([tokens[:20]])).logits[0]
        torch.testing.assert_close(model.logits(hidden), expected, atol=1e-4, rtol=1e-4)
        assert counts.sum().item() == engine.args.top_k * 20 * counts.shape[0]  # 0 for dense models
        for pos in range(20, 24):  # decode steps, one token each, reading the paged cache
            meta = AttentionMetadata(
                torch.tensor([pos]),
                1,
                torch.arange(pos + 1)[None],
                torch.ones(1, 1, 1, pos + 1, dtype=torch.bool),
                [],
            )
            hidden, _ = model(torch.tensor([tokens[pos]]), torch.tensor([pos]), meta, caches)
            expected = ref(torch.tensor([tokens[: pos + 1]])).logits[0, -1]
            torch.testing.assert_close(model.logits(hidden)[0], expected, atol=1e-4, rtol=1e-4)


def check_greedy_alone_matches_generate(path, **options) -> None:
    engine = LLMEngine.from_pretrained(
        path, device="cpu", dtype="float32", kv_cache_tokens=1024, **options
    )
    ref = hf_model(path)
    for prompt in prompts(engine.args.vocab_size, [7, 40]):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(ref, prompt)
        assert out.finish_reason == "length"


def check_continuous_batch_with_chunked_prefill_and_preemption(path, **options) -> None:
    """Mixed prompt lengths, a 24-token step budget (prefills are chunked) and a KV cache of
    12 blocks of 16 tokens, far below what the batch needs, so sequences get preempted."""
    engine = LLMEngine.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        kv_cache_tokens=192,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        **options,
    )
    ref = hf_model(path)
    batch = prompts(engine.args.vocab_size, [5, 61, 17, 33, 9, 48])
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch):
        engine.add_request(rid, prompt, GREEDY_32)
    final, preemptions, chunked = {}, 0, False
    while engine.has_unfinished:
        outputs, stats = engine.step()
        preemptions += stats.num_preemptions
        chunked |= (
            0 < stats.num_prefill_tokens
            and stats.num_prefill_tokens + stats.num_decode_tokens == 24
        )
        final.update({o.request_id: o for o in outputs if o.finished})
    assert preemptions > 0 and chunked
    for rid, prompt in zip(ids, batch):
        assert final[rid].token_ids == hf_greedy(ref, prompt), rid
    assert engine.block_manager.num_used == 0
