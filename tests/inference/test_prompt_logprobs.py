"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): every prompt position's token
logprob and top-k, computed on the prefill, against transformers' log-softmax over the same
prompt. Whole prompts, n > 1, a prompt whose prefix is in the cache, chunked prefill with
preemption in the middle of a prompt, and the CPU kernels in bf16."""

from __future__ import annotations

import pytest
import torch

from inference import LLMEngine, SamplingParams
from tests.inference.kernel_paths import Path, forced
from tests.inference.parity_checks import hf_model, prompts

TOP = 3


def reference(path, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax: row i scores prompt position i + 1."""
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def check(got, prompt: list[int], want: torch.Tensor, atol: float) -> None:
    """Every position once: None first, then each token's logprob and the top TOP."""
    assert len(got) == len(prompt) and got[0] is None
    for pos, entry in enumerate(got[1:], start=1):
        row = want[pos - 1]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=atol), pos
        # its rank: 1 + the tokens above it (those within the tolerance may count either way)
        above = [(row > row[prompt[pos]] + d).sum().item() for d in (atol, -atol)]
        assert above[0] + 1 <= entry.rank <= above[1] + 1, pos
        values = [t.logprob for t in entry.top]
        assert values == pytest.approx(row.topk(TOP).values.tolist(), abs=atol), pos
        # a top token is one of the reference's best (ties within the tolerance may swap)
        for t in entry.top:
            assert row[t.token_id].item() >= row.topk(TOP).values[-1].item() - atol, pos


def engine(path, **options) -> LLMEngine:
    return LLMEngine.from_pretrained(
        path, device="cpu", **{"dtype": "float32", "kv_cache_tokens": 1024, **options}
    )


def scored(prompt_logprobs: int = TOP, **more) -> SamplingParams:
    fields = {"max_tokens": 2, "temperature": 0.0, **more}
    return SamplingParams(prompt_logprobs=prompt_logprobs, **fields)


def test_every_prompt_position_matches_transformers(model_dirs):
    path = model_dirs("mixtral")
    eng = engine(path)
    batch = prompts(eng.args.vocab_size, [2, 13, 40])
    outs = eng.generate(batch, scored())
    for prompt, out in zip(batch, outs):
        check(out.prompt_logprobs, prompt, reference(path, prompt), 1e-4)
    # 0: only each position's own token, as vLLM's prompt_logprobs=0
    [out] = eng.generate(batch[1:2], scored(0))
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    # not asked: none computed, none returned
    [plain] = eng.generate(batch[1:2], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs is None


def test_n_samples_share_one_prompt_scoring(model_dirs):
    path = model_dirs("mixtral")
    eng = engine(path, enable_prefix_caching=True)
    prompt = prompts(eng.args.vocab_size, [21])[0]
    [out] = eng.generate([prompt], scored(n=3, temperature=1.0, seed=5))
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, prompt, reference(path, prompt), 1e-4)


def test_a_prefix_cache_hit_still_scores_every_position(model_dirs):
    """The prompt is read through the model again (the cache holds no logits), and a
    request that does not ask is still served from the cache."""
    path = model_dirs("mixtral")
    eng = engine(path, enable_prefix_caching=True)
    prompt = prompts(eng.args.vocab_size, [40])[0]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    eng.generate([prompt], plain)
    [out] = eng.generate([prompt], scored())
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompt, reference(path, prompt), 1e-4)
    [again] = eng.generate([prompt], plain)
    assert again.num_cached_tokens == 32  # two full blocks of 16


def test_chunked_prefill_and_preemption_give_every_position_once(model_dirs):
    """A 16-token step budget chunks every prompt; a cache of 6 blocks of 16 tokens cannot
    hold the batch, so sequences are preempted, some halfway through their prompt."""
    path = model_dirs("mixtral")
    eng = engine(path, kv_cache_tokens=96, max_num_batched_tokens=16, max_num_seqs=4)
    batch = prompts(eng.args.vocab_size, [37, 29, 44, 18])
    halfway = []
    eng.scheduler.on_preempt = lambda seq: halfway.append(
        1 < len(seq.prompt_logprobs) < seq.num_prompt_tokens
    )
    params = scored(max_tokens=12, min_tokens=12, ignore_eos=True)
    outs = eng.generate(batch, params)
    assert any(halfway), halfway
    for prompt, out in zip(batch, outs):
        check(out.prompt_logprobs, prompt, reference(path, prompt), 1e-4)
    assert eng.block_manager.num_used == 0


@pytest.mark.parametrize(
    "path", [Path("avx512"), Path("avx2"), Path("avx512", emulated=True)], ids=str
)
def test_bf16_on_the_cpu_kernels_is_within_bf16_rounding(model_dirs, path):
    """bf16 weights and activations: logprobs within what bf16 rounding through the layers
    moves them (the random-weight model's logprobs are about -7)."""
    model = model_dirs("mixtral")
    with forced(path):
        eng = engine(model, dtype="bfloat16", max_num_batched_tokens=16)
        batch = prompts(eng.args.vocab_size, [30, 11])
        outs = eng.generate(batch, scored())
    for prompt, out in zip(batch, outs):
        want = reference(model, prompt)
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        exact = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))[:, 0]
        assert (got - exact).abs().max().item() < 0.1
        assert (got - exact).abs().mean().item() < 0.03


def test_a_one_token_chunk_inside_a_prompt_samples_nothing(model_dirs):
    """A 64-token step budget gives the second of two 127-token prompts a first chunk of one
    token (beside the first prompt's last 63): it runs as a decode row, yet it is no decode.
    Both prompts are scored and generate as without chunks."""
    path = model_dirs("mixtral")
    eng = engine(path, max_num_batched_tokens=64)
    batch = prompts(eng.args.vocab_size, [127, 127])
    chunks = []  # (tokens computed before, tokens scheduled, prompt length)
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend((s.num_computed_tokens, n, s.num_prompt_tokens) for s, n in out.scheduled)
        return out

    eng.scheduler.schedule = recorded
    params = scored(max_tokens=4, ignore_eos=True)
    outs = eng.generate(batch, params)
    assert (0, 1, 127) in chunks
    whole = engine(path).generate(batch, params)
    for prompt, out, want in zip(batch, outs, whole):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        check(out.prompt_logprobs, prompt, reference(path, prompt), 1e-4)
