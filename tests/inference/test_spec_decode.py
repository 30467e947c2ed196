"""Speculative decoding (n-gram): config errors, the proposer, greedy outputs identical to
non-speculative decoding for every architecture under chunked prefill and preemption, the
sampled distribution kept by the rejection sampler, KV blocks of rejected drafts released."""

from __future__ import annotations

import json
import shutil
from array import array

import pytest
import torch

from inference import InvalidParameterError, LLMEngine, SamplingParams
from inference.config import EngineConfig
from inference.executor.model_runner import block_table_rows
from inference.executor.sampler import Sampler
from inference.kv_events import BlockStored
from inference.sequence import Sequence
from inference.spec_decode.config import speculative_config
from inference.spec_decode.ngram import propose_ngram
from inference.spec_decode.rejection_sampler import verify
from inference.spec_decode.speculator import MISSES_BEFORE_PAUSE, DraftLength
from inference.spec_decode.step_cost import MIN_SEEN, StepCost
from tests.inference.parity_checks import DEVICE, GREEDY_32, prompts
from tests.inference.test_parity import ARCHS

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, key",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
        ('{"method": "ngram",', "not JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_config_names_the_key(value, key):
    with pytest.raises(InvalidParameterError) as err:
        speculative_config(value)
    assert err.value.param == "speculative_config" and key in err.value.message
    with pytest.raises(InvalidParameterError):  # start-up is stopped by the same check
        EngineConfig(speculative_config=value if isinstance(value, str) else json.dumps(value))


def test_lookup_bounds_default_as_vllm():
    c = speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert speculative_config(None) is None and speculative_config("") is None


def test_mtp_is_refused_at_start_up(model_dirs, tmp_path):
    """Without MTP layers the error names the missing layers; with them declared but no
    weights for them, the missing weights: either way start-up stops, naming the key
    (test_spec_mtp.py serves checkpoints that have them)."""
    with pytest.raises(InvalidParameterError, match="MTP layers") as err:
        LLMEngine(
            model_dirs("mixtral"),
            "cpu",
            "float32",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )
    assert err.value.param == "speculative_config"
    with_mtp = tmp_path / "dsv3-mtp"
    shutil.copytree(model_dirs("deepseek_v3"), with_mtp)
    cfg = json.loads((with_mtp / "config.json").read_text())
    (with_mtp / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    with pytest.raises(InvalidParameterError, match="MTP layer's weights"):
        LLMEngine(
            with_mtp,
            "cpu",
            "float32",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )


# ---- proposer and adaptation ----------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_suffix_match():
    assert propose_ngram([1, 2, 3, 4, 2, 3], 2, 2, 4) == [4, 2, 3]  # vLLM's docstring example
    # the 3-gram [7, 8, 9] wins over the later 1-gram [9]
    assert propose_ngram([7, 8, 9, 5, 6, 9, 1, 7, 8, 9], 1, 3, 2) == [5, 6]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 2, 2, 3) == [3, 1, 2]  # the first occurrence
    assert propose_ngram([5, 6, 7], 1, 2, 3) == []  # no match
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 2) == []  # shorter than prompt_lookup_min
    assert propose_ngram([256, 1, 256], 1, 1, 3) == [1, 256]  # matches on token boundaries


def test_draft_length_follows_acceptance():
    d = DraftLength(4)  # the prior cost: 15% of a one-row step per extra row
    assert d.current(100) == 4  # a fresh sequence drafts the most
    d.record(4, 0, 100)
    d.record(1, 0, 101)
    d.record(1, 0, 102)
    assert d._best() == 0 and d.current(103) == 1  # no k pays: a one-token probe
    d.record(1, 1, 102)
    d.record(4, 4, 104)
    assert d.acceptance > 0.9 and d.current(109) == 4  # copying again: the most
    for n in range(110, 110 + MISSES_BEFORE_PAUSE):
        d.record(d.k, 0, n)
    paused_at = 110 + MISSES_BEFORE_PAUSE - 1
    assert d.current(paused_at + 1) == 0 and d.current(paused_at + 16) > 0  # paused 16 tokens


def test_draft_length_follows_the_measured_cost_of_rows():
    """The same acceptance drafts fewer tokens where extra rows cost more: k maximizes
    expected tokens per unit of step cost (a batch of n rows: n - 1 + 1 + a + ... + a^k)."""
    cheap, dear = StepCost(), StepCost()
    for _ in range(MIN_SEEN):
        for rows in range(1, 6):
            cheap.observe(rows, 1.0 + 0.02 * (rows - 1))
            dear.observe(rows, 1.0 + 0.5 * (rows - 1))
    assert cheap.ratio(5, 1) == pytest.approx(1.08) and dear.ratio(3, 1) == pytest.approx(2.0)
    picks = []
    for cost in (cheap, dear):
        d = DraftLength(4, cost)
        d.record(4, 2, 100)  # acceptance about 0.48
        picks.append(d._best())
    assert picks == [4, 0]
    assert StepCost().ratio(3, 1) == pytest.approx(1.3)  # unmeasured: the prior


def test_step_cost_is_measured_on_decode_steps_of_a_speculating_engine(model_dirs):
    engine = LLMEngine.from_pretrained(
        model_dirs("mixtral"),
        DEVICE,
        "float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=24, temperature=0.0))
    cost = engine.speculator.cost
    assert sum(cost.seen.values()) >= 8 and all(r >= 1 for r in cost.seen)
    assert all(cost.mean[r] > 0 for r in cost.seen)


# ---- greedy parity --------------------------------------------------------------------------
def _run(engine: LLMEngine, batch, params):
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch):
        engine.add_request(rid, prompt, params)
    final, totals = {}, {"preempted": 0, "chunked": False, "drafts": 0, "accepted": 0}
    while engine.has_unfinished:
        outputs, stats = engine.step()
        totals["preempted"] += stats.num_preemptions
        totals["chunked"] |= stats.num_prefill_tokens >= 2 and (
            stats.num_prefill_tokens + stats.num_decode_tokens == 24
        )
        totals["drafts"] += stats.spec_num_draft_tokens
        totals["accepted"] += stats.spec_num_accepted_tokens
        final.update({o.request_id: o.token_ids for o in outputs if o.finished})
    assert engine.block_manager.num_used == 0
    return [final[rid] for rid in ids], totals


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_speculation_under_chunked_prefill_and_preemption(model_dirs, arch):
    """The batch of parity_checks' preemption test (24-token budget, 12 blocks of 16), plus a
    prompt that repeats itself, with and without n-gram drafts."""
    path = model_dirs(arch)
    limits = {
        "device": DEVICE,
        "dtype": "float32",
        "kv_cache_tokens": 192,
        "max_num_batched_tokens": 24,
        "max_num_seqs": 8,
    }
    plain = LLMEngine.from_pretrained(path, **limits)
    batch = prompts(plain.args.vocab_size, [5, 61, 17, 33, 9, 48])
    batch.append(batch[0] * 4)
    expected, _ = _run(plain, batch, GREEDY_32)
    spec = LLMEngine.from_pretrained(path, speculative_config=NGRAM, **limits)
    got, totals = _run(spec, batch, GREEDY_32)
    assert got == expected
    assert totals["preempted"] > 0 and totals["chunked"]
    assert totals["drafts"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_identical_with_speculation(model_dirs, arch, monkeypatch):
    """In bf16 too: a sequence's last token and its drafts are verified as k + 1 rows of the
    decode step (the fused one-call step on the CPU kernels), each rounding as a plain decode
    step does, so the output is the same token for token, drafts accepted or not. The engine
    without drafts asks batch invariance (a speculating one has it), so its batched rows round
    as alone too."""
    monkeypatch.setenv("MOESERVE_BATCH_INVARIANT", "1")
    path = model_dirs(arch)
    limits = {"device": DEVICE, "dtype": "bfloat16", "kv_cache_tokens": 1024}
    plain = LLMEngine.from_pretrained(path, **limits)
    batch = prompts(plain.args.vocab_size, [5, 33, 12])
    batch.append(batch[2] * 4)  # repeats itself: drafts get accepted
    expected, _ = _run(plain, batch, GREEDY_32)
    spec = LLMEngine.from_pretrained(path, speculative_config=NGRAM, **limits)
    got, totals = _run(spec, batch, GREEDY_32)
    assert got == expected
    assert totals["accepted"] > 0


def test_repeating_output_accepts_drafts_and_stored_blocks_hold_only_kept_tokens(model_dirs):
    """A prompt that repeats itself: drafts get accepted (the step's counts), the prefix cache's
    KV events carry only tokens the sequence kept, and the blocks of rejected drafts go back."""
    engine = LLMEngine.from_pretrained(
        model_dirs("mixtral"),
        device=DEVICE,
        dtype="float32",
        kv_cache_tokens=1024,
        speculative_config=NGRAM,
    )
    engine.block_manager.record_events()
    base = prompts(engine.args.vocab_size, [12])[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", base * 3, params)
    drafts = accepted = generated = 0
    per_pos = []
    while engine.has_unfinished:
        outputs, stats = engine.step()
        generated += stats.num_generated_tokens
        drafts += stats.spec_num_draft_tokens
        accepted += stats.spec_num_accepted_tokens
        if stats.spec_accepted_per_pos:
            per_pos.append(stats.spec_accepted_per_pos)
        out = outputs[0]
    assert accepted > 0 and drafts >= accepted
    assert sum(map(sum, per_pos)) == accepted
    assert generated == len(out.token_ids) == 40  # not a token past max_tokens counted
    tokens = out.prompt_token_ids + out.token_ids
    times = out.outputs[0].times
    assert (times.spec_draft_tokens, times.spec_accepted_tokens) == (drafts, accepted)
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    offset = 0
    for event in stored:  # each stored run continues the sequence's own tokens
        assert event.token_ids == tokens[offset : offset + len(event.token_ids)]
        offset += len(event.token_ids)
    assert offset == (len(tokens) - 1) // 16 * 16
    assert engine.block_manager.num_used == 0
    # the cached blocks serve the same prompt again, with the same output
    again = engine.generate([base * 3], params)[0]
    assert again.token_ids == out.token_ids and again.num_cached_tokens >= 32


def test_no_speculation_past_disable_by_batch_size(model_dirs):
    engine = LLMEngine.from_pretrained(
        model_dirs("mixtral"),
        device=DEVICE,
        dtype="float32",
        kv_cache_tokens=1024,
        speculative_config=NGRAM | {"disable_by_batch_size": 1},
    )
    base = prompts(engine.args.vocab_size, [12])[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(rid, base * 3, params)
    drafts = 0
    while engine.has_unfinished:
        _, stats = engine.step()
        drafts += stats.spec_num_draft_tokens if stats.num_running > 1 else 0
    assert drafts == 0


# ---- the sampled distribution ---------------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """Tiny vocabulary, fixed seed: whatever the draft, each emitted token follows the target's
    (temperature- and top-k-processed) distribution at its position. The bound (5 standard
    errors on every token's frequency) fails for a sampler that keeps drafts too often or
    too rarely (accepting always gives frequency 1 for the draft, p(d) = 0.3 here)."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    sampler = Sampler(vocab, eos_token_ids={0})
    logits = torch.tensor(
        [
            [0.0, 1.0, 0.4, 2.0, -1.0, 0.5],
            [1.5, 0.0, 0.8, 0.2, 1.0, -0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],
        ]
    )
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=16)
    seq = Sequence("s", "s", 0, [1, 2], params, None)
    draft = [2, 0]  # the first draft is unlikely, the second likely
    target = sampler.probs(logits, [params] * 3, [False] * 3)
    target = target / target.sum(dim=-1, keepdim=True)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    kept_first = 0
    batch = 1000  # sequences verified together, each with its own draws
    for _ in range(trials // batch):
        for tokens in verify(sampler, logits.repeat(batch, 1), [(seq, draft)] * batch):
            first[tokens[0]] += 1
            if tokens[0] == draft[0]:
                kept_first += 1
                second[tokens[1]] += 1
    assert kept_first > 0 and first[4] == 0, (kept_first, first)  # top-k removed token 4
    for counts, p in ((first, target[0]), (second, target[1])):
        n = counts.sum()
        stderr = (p * (1 - p) / n).sqrt()
        assert ((counts / n - p).abs() <= 5 * stderr + 1e-9).all(), (counts / n, p)


def test_greedy_verification_takes_the_top_token_and_min_tokens():
    sampler = Sampler(4, eos_token_ids={0})
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.0], [3.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    seq = Sequence("s", "s", 0, [1], greedy, None)
    assert verify(sampler, logits, [(seq, [1, 0])]) == [[1, 0, 3]]  # all accepted + bonus
    assert verify(sampler, logits, [(seq, [2, 0])]) == [[1]]  # first rejected: the top token
    # min_tokens 2: EOS (0) is banned at the second position, so the draft's EOS is rejected
    seq = Sequence("s", "s", 0, [1], SamplingParams(temperature=0.0, min_tokens=2), None)
    assert verify(sampler, logits, [(seq, [1, 0])]) == [[1, 2]]


def test_the_flag_is_checked_when_parsed():
    """--speculative-config: a bad value is a usage error naming the key; a good one reaches
    the engine's config."""
    from service.cli import build_parser
    from service.settings import from_namespace

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "medusa"}'])
    good = '{"method": "ngram", "num_speculative_tokens": 3}'
    settings = from_namespace(build_parser().parse_args(["serve", "--speculative-config", good]))
    assert settings.engine_limits()["speculative_config"] == good


def test_stops_max_tokens_and_sampling_with_speculation(model_dirs):
    """A stop token met among accepted drafts ends the output there, max_tokens is never
    passed, as without speculation; sampled requests (temperature, top-p) speculate and
    finish too, with every block returned."""
    path = model_dirs("mixtral")
    limits = {"device": DEVICE, "dtype": "float32", "kv_cache_tokens": 1024}
    plain = LLMEngine.from_pretrained(path, **limits)
    spec = LLMEngine.from_pretrained(path, speculative_config=NGRAM, **limits)
    prompt = prompts(plain.args.vocab_size, [12])[0] * 3
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = plain.generate([prompt], greedy)[0].token_ids
    stop = full[20]
    cut = full.index(stop) + 1
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
    ):
        [expected] = plain.generate([prompt], params)
        [got] = spec.generate([prompt], params)
        assert got.token_ids == expected.token_ids
        assert got.finish_reason == expected.finish_reason
    assert len(expected.token_ids) == 13 and cut <= 21
    sampled = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, ignore_eos=True, n=2)
    [out] = spec.generate([prompt], sampled)
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]
    assert spec.block_manager.num_used == 0


def test_block_tables_of_decode_rows_pad_and_repeat_each_sequence():
    """A verified sequence's k + 1 rows each carry its block table; shorter tables are padded
    with block 0 (the runner's paged-kernel metadata)."""
    long, short = Sequence.__new__(Sequence), Sequence.__new__(Sequence)
    long.block_table, short.block_table = array("i", range(40, 0, -1)), array("i", [7, 3])
    rows = [(long, 10), (long, 11), (long, 12), (short, 20), (long, 30)]
    tables = block_table_rows(rows)
    expected = [list(s.block_table) + [0] * (40 - len(s.block_table)) for s, _ in rows]
    assert tables.dtype == torch.int32 and tables.tolist() == expected
    alone = block_table_rows([(short, 20)])
    assert alone.tolist() == [[7, 3]]
