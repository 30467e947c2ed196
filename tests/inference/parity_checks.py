"""Parity checks of our engine against transformers (float32), shared by the architecture
tests: prefill/decode logits, greedy decoding alone, greedy decoding inside a continuous
batch with chunked prefill and forced preemption, and bf16 logits against float32.

They run on DEVICE: MOESERVE_TEST_DEVICE (default cpu; bench/gpu_check.sh sets cuda), both
engine and transformers. A device that is not there fails them rather than skipping them."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

from inference import LLMEngine, SamplingParams
from inference.models.attention import AttentionMetadata, PrefillChunk

DEVICE = os.environ.get("MOESERVE_TEST_DEVICE", "cpu")
# min_tokens: transformers' min_new_tokens masks the EOS ids, so the engine must too
GREEDY_32 = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, ignore_eos=True)


def hf_model(path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def model_logits(engine: LLMEngine, tokens: list[int], prefill: int) -> list[torch.Tensor]:
    """Our logits over `tokens`: the first `prefill` in one prefill chunk ([prefill, V]), then
    one decode step per token ([V] each) reading the paged cache through gathered slots."""
    model, caches, dev = engine.executor.model, engine.executor.kv_caches, engine.device
    with torch.inference_mode():
        meta = AttentionMetadata(
            torch.arange(prefill, device=dev), 0, None, None, [PrefillChunk(0, prefill, 0, None)]
        )
        positions = torch.arange(prefill, device=dev)
        hidden, counts = model(torch.tensor(tokens[:prefill], device=dev), positions, meta, caches)
        assert counts.sum().item() == engine.args.top_k * prefill * counts.shape[0]  # 0: dense
        logits = [model.logits(hidden)]
        for pos in range(prefill, len(tokens)):
            meta = AttentionMetadata(
                torch.tensor([pos], device=dev),
                1,
                torch.arange(pos + 1, device=dev)[None],
                torch.ones(1, 1, 1, pos + 1, dtype=torch.bool, device=dev),
                [],
            )
            step = torch.tensor([tokens[pos]], device=dev), torch.tensor([pos], device=dev)
            hidden, _ = model(*step, meta, caches)
            logits.append(model.logits(hidden)[0])
    return logits


def reference_logits(ref, tokens: list[int], prefill: int) -> list[torch.Tensor]:
    """transformers' logits at the same positions as model_logits()."""
    with torch.inference_mode():
        full = ref(torch.tensor([tokens], device=ref.device)).logits[0]
    return [full[:prefill], *full[prefill:]]


def check_logits_match(path) -> None:
    engine = LLMEngine.from_pretrained(path, device=DEVICE, dtype="float32", kv_cache_tokens=512)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    ours = model_logits(engine, tokens, 20)
    expected = reference_logits(hf_model(path, DEVICE), tokens, 20)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def bf16_logits_error(path) -> tuple[float, float]:
    """Mean |logit - transformers' float32 logit| over a 20-token prefill and 4 decode steps:
    of our bf16 engine, and of transformers' own bf16 model (what bf16 costs anyway)."""
    engine = LLMEngine.from_pretrained(path, device=DEVICE, dtype="bfloat16", kv_cache_tokens=512)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    exact = reference_logits(hf_model(path, DEVICE), tokens, 20)
    theirs = reference_logits(hf_model(path, DEVICE, torch.bfloat16), tokens, 20)
    ours = model_logits(engine, tokens, 20)

    def error(logits: list[torch.Tensor]) -> float:
        return torch.cat([(a.float() - b).abs().flatten() for a, b in zip(logits, exact)]).mean()

    return float(error(ours)), float(error(theirs))


def check_greedy_alone_matches_generate(path, **options) -> None:
    engine = LLMEngine.from_pretrained(
        path, device=DEVICE, dtype="float32", kv_cache_tokens=1024, **options
    )
    ref = hf_model(path, DEVICE)
    for prompt in prompts(engine.args.vocab_size, [7, 40]):
        [out] = engine.generate([prompt], GREEDY_32)
        assert out.token_ids == hf_greedy(ref, prompt)
        assert out.finish_reason == "length"


def check_continuous_batch_with_chunked_prefill_and_preemption(path, **options) -> None:
    """Mixed prompt lengths, a 24-token step budget (prefills are chunked) and a KV cache of
    12 blocks of 16 tokens, far below what the batch needs, so sequences get preempted."""
    engine = LLMEngine.from_pretrained(
        path,
        device=DEVICE,
        dtype="float32",
        kv_cache_tokens=192,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        **options,
    )
    ref = hf_model(path, DEVICE)
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
