"""Speculative method "mtp" (DeepSeek-V3, GLM-4.5): the checkpoint's MTP layer drafts, the target
verifies. Greedy output identical with and without it (chunked prefill and preemption in the
batch), in float32 and on the bf16 CPU kernels; an MTP layer that predicts well gets its drafts
accepted; start-up refuses checkpoints without one, naming the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inference import InvalidParameterError, LLMEngine, SamplingParams
from inference.checkpoints.mtp_layer import write_with_mtp_layer
from inference.executor.kv_cache import allocate_kv_cache
from inference.models.attention import AttentionMetadata, PrefillChunk
from inference.spec_decode.config import speculative_config
from tests.inference.parity_checks import DEVICE, GREEDY_32, prompts
from tests.inference.test_spec_decode import _run

MTP_ARCHS = ("deepseek_v3", "glm4_moe")
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# parity_checks' preemption batch limits: a 24-token budget (chunked prefill), 12 blocks of 16
TIGHT = {"device": DEVICE, "dtype": "float32", "kv_cache_tokens": 192}
TIGHT |= {"max_num_batched_tokens": 24, "max_num_seqs": 8}


def _mtp_engine(path, **limits) -> LLMEngine:
    return LLMEngine.from_pretrained(path, speculative_config=MTP, **limits)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_greedy_identical_with_mtp_under_chunked_prefill_and_preemption(model_dirs, tmp_path, arch):
    """An MTP layer of the checkpoint's own shape (a copy of the last layer, eh_proj at random):
    whatever it drafts, the output is the target's."""
    path = write_with_mtp_layer(model_dirs(arch), tmp_path / arch)
    plain = LLMEngine.from_pretrained(path, **TIGHT)
    batch = prompts(plain.args.vocab_size, [5, 61, 17, 33, 9, 48])
    batch.append(batch[0] * 4)
    expected, _ = _run(plain, batch, GREEDY_32)
    spec = _mtp_engine(path, **TIGHT)
    assert spec.executor.model.mtp is not None  # the MTP layer is built and loaded
    got, totals = _run(spec, batch, GREEDY_32)
    assert got == expected
    assert totals["preempted"] > 0 and totals["chunked"]
    assert totals["drafts"] > 0


def _reference_drafts(engine: LLMEngine, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The MTP layer's output and prediction at every position of `tokens`, computed in one
    pass with no cache history: the target over the whole sequence as one prompt, then the
    MTP layer over it with each position's next token (vLLM's semantics, models/mtp.py)."""
    model, args, n = engine.executor.model, engine.args, len(tokens) - 1
    caches = allocate_kv_cache(args, -(-n // 16), 16, torch.float32, torch.device("cpu"))
    positions = torch.arange(n)
    meta = AttentionMetadata(positions, 0, None, None, [PrefillChunk(0, n, 0, None)])
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(tokens[:n]), positions, meta, caches[:-1])
        embeds = model.embed(torch.tensor(tokens[1:]))
        cos, sin = model.rope.tables(positions, embeds.dtype)
        out = model.mtp(embeds, positions, hidden, cos, sin, meta, caches[-1])
        return out, model.mtp.logits(out, model.lm_head).argmax(dim=-1).tolist()


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_each_first_draft_is_the_mtp_layers_prediction_over_the_whole_sequence(
    model_dirs, tmp_path, arch
):
    """The MTP layer's KV cache, filled piece by piece (chunked prompts, decode rows, verified
    rows past what was accepted, preemption), drafts what one pass over the whole sequence
    predicts: the draft made after position q, and the hidden state it came from, are the
    reference's at q."""
    path = write_with_mtp_layer(model_dirs(arch), tmp_path / arch)
    spec = _mtp_engine(path, **TIGHT)
    batch = prompts(spec.args.vocab_size, [5, 61, 17, 33])
    for i, prompt in enumerate(batch):
        spec.add_request(f"r{i}", prompt, GREEDY_32)
    seen: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    sequences = {}
    preempted = 0
    while spec.has_unfinished:
        _, stats = spec.step()
        preempted += stats.num_preemptions
        for seq in spec.scheduler.running:
            state = seq.mtp_state
            if state is not None and state.is_current(seq):
                seen.setdefault(seq.seq_id, {})[state.position] = (state.token, state.hidden)
                sequences[seq.seq_id] = seq
    assert preempted > 0 and sum(map(len, seen.values())) > 40
    for seq_id, drafts in seen.items():
        hidden, reference = _reference_drafts(spec, sequences[seq_id].token_ids)
        assert {q: t for q, (t, _) in drafts.items()} == {q: reference[q] for q in drafts}
        got = torch.stack([h for _, h in drafts.values()])
        torch.testing.assert_close(got, hidden[list(drafts)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_an_mtp_layer_that_predicts_the_target_gets_its_drafts_accepted(model_dirs, tmp_path, arch):
    """The MTP layer computes what the target computes one position later
    (checkpoints/mtp_layer.py, self_predicting): nearly every draft is the
    target's next token, at every draft position (k = 3 drafts from one MTP layer run
    autoregressively), and the output is the target's."""
    path = write_with_mtp_layer(model_dirs(arch), tmp_path / arch, self_predicting=True)
    limits = {"device": DEVICE, "dtype": "float32", "kv_cache_tokens": 1024}
    plain = LLMEngine.from_pretrained(path, **limits)
    batch = prompts(plain.args.vocab_size, [5, 33, 12])
    expected, _ = _run(plain, batch, GREEDY_32)
    spec = _mtp_engine(path, **limits)
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch):
        spec.add_request(rid, prompt, GREEDY_32)
    drafts = accepted = 0
    per_pos = [0, 0, 0]
    final = {}
    while spec.has_unfinished:
        outputs, stats = spec.step()
        drafts += stats.spec_num_draft_tokens
        accepted += stats.spec_num_accepted_tokens
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            per_pos[pos] += n
        final |= {o.request_id: o for o in outputs if o.finished}
    assert [final[rid].token_ids for rid in ids] == expected
    assert drafts > 0 and accepted >= 0.9 * drafts, (accepted, drafts)
    assert sum(per_pos) == accepted and per_pos[2] > 0  # the third draft too
    times = [final[rid].outputs[0].times for rid in ids]
    assert sum(t.spec_accepted_tokens for t in times) == accepted
    assert spec.block_manager.num_used == 0


def test_an_mtp_layer_without_its_own_head_reads_the_targets(model_dirs, tmp_path):
    """GLM-4.6's MTP layer ships no shared_head.head (nor embed_tokens): the target's lm_head
    serves, as vLLM shares it; its drafts are accepted and the output is the target's."""
    path = write_with_mtp_layer(
        model_dirs("glm4_moe"), tmp_path / "m", self_predicting=True, own_head=False
    )
    limits = {"device": DEVICE, "dtype": "float32", "kv_cache_tokens": 1024}
    plain = LLMEngine.from_pretrained(path, **limits)
    batch = prompts(plain.args.vocab_size, [5, 33])
    expected, _ = _run(plain, batch, GREEDY_32)
    spec = _mtp_engine(path, **limits)
    assert spec.executor.model.mtp.head is None
    got, totals = _run(spec, batch, GREEDY_32)
    assert got == expected
    assert totals["drafts"] > 0 and totals["accepted"] >= 0.9 * totals["drafts"]


def test_bf16_greedy_identical_with_mtp_on_the_cpu_kernels(model_dirs, tmp_path, monkeypatch):
    """On the bf16 CPU kernels (the MTP layer's modules swapped for the kernels' too): the
    engine without drafts asks batch invariance, as test_spec_decode's bf16 test does."""
    monkeypatch.setenv("MOESERVE_BATCH_INVARIANT", "1")
    path = write_with_mtp_layer(model_dirs("deepseek_v3"), tmp_path / "m", self_predicting=True)
    limits = {"device": DEVICE, "dtype": "bfloat16", "kv_cache_tokens": 1024}
    plain = LLMEngine.from_pretrained(path, **limits)
    batch = prompts(plain.args.vocab_size, [5, 33, 12])
    expected, _ = _run(plain, batch, GREEDY_32)
    got, totals = _run(_mtp_engine(path, **limits), batch, GREEDY_32)
    assert got == expected
    assert totals["accepted"] > 0


def test_sampled_requests_speculate_with_mtp_and_return_every_block(model_dirs, tmp_path):
    path = write_with_mtp_layer(model_dirs("glm4_moe"), tmp_path / "m", self_predicting=True)
    spec = _mtp_engine(path, device=DEVICE, dtype="float32", kv_cache_tokens=1024)
    prompt = prompts(spec.args.vocab_size, [12])[0]
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, ignore_eos=True, n=2)
    [out] = spec.generate([prompt], params)
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]
    assert sum(c.times.spec_draft_tokens for c in out.outputs) > 0
    assert spec.block_manager.num_used == 0


def test_mtp_on_a_checkpoint_without_its_layer_stops_start_up_naming_the_key(model_dirs, tmp_path):
    """No MTP layer in config.json; one declared (the DeepSeek-V3 demo's config says 1) but no
    weights; MiniMax-M2's declared modules, which no vLLM drafter runs: each refused with
    the speculative_config key named."""
    with_minimax = tmp_path / "minimax"
    shutil.copytree(model_dirs("minimax_m2"), with_minimax)
    cfg = json.loads((with_minimax / "config.json").read_text())
    (with_minimax / "config.json").write_text(json.dumps(cfg | {"num_mtp_modules": 3}))
    for path, says in (
        (model_dirs("mixtral"), "num_nextn_predict_layers > 0"),
        (model_dirs("deepseek_v3"), "model.layers.2.*"),
        (with_minimax, "MiniMaxM2ForCausalLM"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            _mtp_engine(path, device="cpu", dtype="float32")
        assert err.value.param == "speculative_config" and says in err.value.message


def test_vllms_former_mtp_method_names_stand_for_mtp():
    for name in ("deepseek_mtp", "glm4_moe_mtp"):
        config = speculative_config({"method": name, "num_speculative_tokens": 2})
        assert (config.method, config.num_speculative_tokens) == ("mtp", 2)
