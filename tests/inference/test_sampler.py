"""Sampling on known logits."""

from __future__ import annotations

import torch

from inference.executor.sampler import Sampler
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence

V = 8


def seqs(*params, prompt=(1, 2), outputs=()):
    out = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        s = Sequence(f"s{i}", f"s{i}", 0, list(prompt), p, gen)
        s.token_ids.extend(outputs)
        out.append(s)
    return out


def draw(logits, params, n=400, **kw):
    sampler = Sampler(V, eos_token_ids={0})
    counts = torch.zeros(V)
    for _ in range(n):
        [tok] = sampler(logits.clone().unsqueeze(0), seqs(params, **kw)).token_ids
        counts[tok] += 1
    return counts


LOGITS = torch.tensor([0.0, 3.0, 2.9, 2.8, 1.0, 0.5, 0.2, 0.1])


def test_greedy_takes_argmax():
    assert Sampler(V, {0})(LOGITS.unsqueeze(0), seqs(SamplingParams(temperature=0))).token_ids == [
        1
    ]


def test_top_k_limits_support():
    counts = draw(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2}


def test_top_p_limits_support():
    probs = LOGITS.softmax(-1)  # tokens 1, 2, 3 hold most of the mass
    top_p = float(probs[1] + probs[2]) - 1e-3
    counts = draw(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2}


def test_min_p_drops_unlikely_tokens():
    counts = draw(LOGITS, SamplingParams(temperature=1.0, min_p=0.5))
    assert set(torch.nonzero(counts).flatten().tolist()) <= {1, 2, 3} and counts[1] > 0


def test_temperature_sharpens():
    hot = draw(LOGITS, SamplingParams(temperature=2.0))
    cold = draw(LOGITS, SamplingParams(temperature=0.2))
    assert cold[1] > hot[1] and (hot > 0).sum() > (cold > 0).sum()


def test_penalties_change_the_choice():
    sampler = Sampler(V, {0})
    greedy = {"temperature": 0.0}
    # token 1 already generated twice: frequency/presence penalties push it below token 2
    for p in (
        SamplingParams(frequency_penalty=0.2, **greedy),
        SamplingParams(presence_penalty=0.5, **greedy),
        SamplingParams(repetition_penalty=1.5, **greedy),
    ):
        assert sampler(LOGITS.unsqueeze(0), seqs(p, prompt=(7,), outputs=(1, 1))).token_ids == [
            2
        ], p
    # the repetition penalty also covers prompt tokens
    assert sampler(
        LOGITS.unsqueeze(0), seqs(SamplingParams(repetition_penalty=1.5, **greedy), prompt=(1,))
    ).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([9.0, 1.0, 0.0, 0.0, 0.0, 0.0, 8.0, 0.0])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    assert Sampler(V, {0})(logits.unsqueeze(0), seqs(p)).token_ids == [1]
    assert Sampler(V, {0})(logits.unsqueeze(0), seqs(p, outputs=(3, 3))).token_ids == [0]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    sampler = Sampler(V, {0})
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sampler(LOGITS.unsqueeze(0), [s]).token_ids[0] for s in seqs(p) for _ in range(1)]
    s1 = seqs(p)[0]
    run1 = [sampler(LOGITS.unsqueeze(0), [s1]).token_ids[0] for _ in range(20)]
    s2 = seqs(p)[0]
    others = seqs(SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=3))
    run2 = [
        sampler(LOGITS.repeat(3, 1), [others[0], s2, others[1]]).token_ids[1] for _ in range(20)
    ]
    assert run1 == run2 and alone[0] == run1[0]
    assert len(set(run1)) > 1  # it really samples


def test_logprobs_are_raw_log_softmax_with_top_n():
    p = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler(V, {0})(LOGITS.unsqueeze(0), seqs(p))
    lp = out.logprobs[0]
    expected = LOGITS.log_softmax(-1)
    assert lp.token_id == 1 and abs(lp.logprob - expected[1].item()) < 1e-6
    assert [t.token_id for t in lp.top] == [1, 2, 3]
    assert abs(lp.top[2].logprob - expected[3].item()) < 1e-6
