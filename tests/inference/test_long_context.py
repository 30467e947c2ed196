"""A 32K-token request on the tiny demo model (its preset serves 32,768 positions) beside 8
short streams: it completes, and while its prompt is prefilled in chunks the streams that
were already decoding get a token every step (the scheduler hands them their token before
the chunk takes the rest of the step's budget)."""

from __future__ import annotations

import pytest
import torch

from inference import LLMEngine, SamplingParams

CONTEXT = 32768
SHORT_STREAMS, SHORT_OUTPUT, LONG_OUTPUT = 8, 24, 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_a_32k_token_request_completes_beside_8_decoding_streams(tiny_model_dir):
    engine = LLMEngine.from_pretrained(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=CONTEXT,
        kv_cache_tokens=CONTEXT + 2048,
        enable_prefix_caching=False,
    )
    assert engine.max_model_len == CONTEXT
    g = torch.Generator().manual_seed(0)
    vocab = engine.args.vocab_size
    for i in range(SHORT_STREAMS):
        engine.add_request(
            f"short-{i}", torch.randint(3, vocab, (16,), generator=g).tolist(), greedy(SHORT_OUTPUT)
        )
    engine.step()  # the short prompts, prefilled together: decoding from here on
    long_prompt = torch.randint(3, vocab, (CONTEXT - LONG_OUTPUT,), generator=g).tolist()
    engine.add_request("long", long_prompt, greedy(LONG_OUTPUT))
    emitted = {f"short-{i}": 1 for i in range(SHORT_STREAMS)}
    prefill_steps, finished = 0, {}
    while engine.has_unfinished:
        outs, _ = engine.step()
        by_id = {o.request_id: o for o in outs}
        long_out = by_id.get("long")
        if long_out is None or not long_out.token_ids:  # the long prompt still prefilling
            prefill_steps += 1
            for rid, before in emitted.items():
                if rid not in finished:  # every unfinished stream decoded this step
                    got = by_id.get(rid)
                    assert got is not None and len(got.token_ids) == before + 1, rid
        for rid, out in by_id.items():
            if rid in emitted:
                emitted[rid] = len(out.token_ids)
            if out.finished:
                finished[rid] = out
    assert prefill_steps >= CONTEXT // engine.config.max_num_batched_tokens  # chunked
    assert len(finished) == SHORT_STREAMS + 1
    assert all(len(o.token_ids) == SHORT_OUTPUT for r, o in finished.items() if r != "long")
    long_out = finished["long"]
    assert len(long_out.token_ids) == LONG_OUTPUT and long_out.finish_reason == "length"
    assert len(long_out.prompt_token_ids) + LONG_OUTPUT == CONTEXT
