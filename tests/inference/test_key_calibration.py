"""The int4 cache's calibrated keys (inference/executor/key_calibration.py): a shift (keys less
their mean per layer and kv head) and a rounding (each key row rounded as GPTQ rounds a
weight row, for the error the queries see). The rope kernel takes the shift off and writes
the rounded rows as torch does, byte for byte, on every kernel path; torch's rounding against
a value-by-value reference, and what it buys; the engine's shift and rounding factor are
what transformers' own keys and queries give over the calibration text; softmax does not see
the shift (a bf16 cache shifted by a large m serves the unshifted logprobs through chunked
prefill, prefix hits and the fused decode step); the layers each must not touch (sinks, MLA);
and the switches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inference import SamplingParams
from inference.executor import executor as executor_module
from inference.executor import key_calibration as calibration
from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache
from inference.models.attention import AttentionMetadata, PagedAttention
from inference.models.layers import apply_rope
from inference.quantization.hadamard import rotate
from tests.inference.parity_checks import hf_model, prompts
from tests.inference.test_cpu_kernels import path, randn  # noqa: F401 (the fixture)
from tests.inference.test_kv_int4 import int4_cache
from tests.inference.test_quantization import engine, prompt_logprobs


def shifted_keys(qkv, cos, sin, h, g, m):
    """The reference: keys after RoPE, less m, rounded to bf16 once."""
    return (apply_rope(qkv[:, : h + g], cos, sin)[:, h:].float() - m).bfloat16()


def anisotropic_queries(n: int, d: int, seed: int) -> torch.Tensor:
    """Queries whose second moment is far from the identity (a few directions dominate, as
    a trained head's do), already in the rotated space."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    return (torch.randn(n, d, generator=gen) * torch.logspace(1, -2, d)) @ basis.T


def rounding_factors(g: int, d: int) -> torch.Tensor:
    return torch.stack(
        [calibration.rounding_factor(anisotropic_queries(400, d, s)) for s in range(g)]
    )


@pytest.mark.parametrize("storage", ["int4", "bf16"])
def test_the_rope_kernel_shifts_and_rounds_keys_as_torch_does(path, storage):  # noqa: F811
    """The kernel's keys (returned in place) and cache rows equal torch's: PagedAttention's
    rope_and_write, and the reference above written by paged_cache.write_kv with the same
    rounding factors (a bf16 cache has no rounding to do)."""
    t, h, g, d = 19, 4, 2, 64  # 19 rows: the threaded loop too
    qkv = randn(t, h + 2 * g, d)
    cos, sin = randn(t, 1, d, seed=1), randn(t, 1, d, seed=2)
    m = torch.randn(g, d, generator=torch.Generator().manual_seed(3)) * 4
    hinv = rounding_factors(g, d)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:t]

    def caches():
        if storage == "int4":
            return int4_cache(32, g, d), int4_cache(32, g, d)
        return (torch.zeros(32, g, d, dtype=torch.bfloat16) for _ in range(2))

    expected = shifted_keys(qkv, cos, sin, h, g, m)
    ours, (kc, vc) = qkv.clone(), caches()
    cpu_kernels.rope_and_cache(ours, cos, sin, h, g, slots, kc, vc, m, hinv)
    assert torch.equal(ours[:, h : h + g], expected)
    assert torch.equal(ours[:, h + g :], qkv[:, h + g :])  # values as they were
    rk, rv = caches()
    paged_cache.write_kv(rk, slots, expected, hinv)
    paged_cache.write_kv(rv, slots, qkv[:, h + g :])
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))
    if storage == "int4":  # the rounding did round differently
        plain, _ = caches()
        paged_cache.write_kv(plain, slots, expected)
        assert not torch.equal(plain.view(torch.uint8), rk.view(torch.uint8))

    module = PagedAttention(h, g, 1.0)
    module.key_shift, module.key_hinv = m, hinv
    meta = AttentionMetadata(slots, 0, None, None, [])
    tk, tv = caches()
    _, k, _ = module.rope_and_write(qkv, cos, sin, meta, tk, tv)
    assert torch.equal(k, expected)
    assert torch.equal(tk.view(torch.uint8), rk.view(torch.uint8))
    with pytest.raises(ValueError, match="key shift"):
        cpu_kernels.rope_and_cache(qkv.clone(), cos, sin, h, g, slots, kc, vc, m[:, :32])
    with pytest.raises(ValueError, match="key rounding"):
        cpu_kernels.rope_and_cache(qkv.clone(), cos, sin, h, g, slots, kc, vc, m, hinv[:1])


def reference_levels(row: np.ndarray, scales: list[float], hinv: np.ndarray) -> list[int]:
    """GPTQ's loop for one rotated row, value by value in Python floats (double), each error
    rounded to float32 before it is carried."""
    w = [float(v) for v in row]
    levels = []
    for i in range(len(w)):
        s = scales[i // paged_cache.INT4_GROUP]
        r = min(max(w[i] / s if s > 0 else 0.0, -8.0), 7.0)
        level = float(np.round(r))  # half to even
        levels.append(int(level))
        err = float(np.float32((w[i] - level * s) / float(hinv[i, i])))
        for j in range(i + 1, len(w)):
            w[j] -= err * float(hinv[i, j])
    return levels


def test_weighted_rounding_is_gptq_s_loop_and_cuts_the_error_queries_see():
    """quantize_int4 with weights against reference_levels, row by row (head width 80: a
    shorter last group); and over 256 rows, the error the head's queries see, E[(q . e)^2],
    falls by a fifth or more while the squared error grows (the trade it makes)."""
    g, d, rows = 2, 80, 256
    keys = torch.randn(rows, g, d, generator=torch.Generator().manual_seed(5))
    queries = [anisotropic_queries(600, d, s) for s in range(g)]
    hinv = torch.stack([calibration.rounding_factor(q) for q in queries])
    weighted = paged_cache.quantize_int4(keys, hinv)
    plain = paged_cache.quantize_int4(keys)
    assert torch.equal(weighted[..., d // 2 :], plain[..., d // 2 :])  # the same scales
    scales = weighted[..., d // 2 :].contiguous().view(torch.bfloat16).float()
    low, high = (weighted[..., : d // 2] & 15).long() - 8, (weighted[..., : d // 2] >> 4).long() - 8
    x = rotate(keys)
    for r in range(0, rows, 37):
        for head in range(g):
            got = []
            for g0 in range(0, d, paged_cache.INT4_GROUP):
                n = min(paged_cache.INT4_GROUP, d - g0)
                got += low[r, head, g0 // 2 : g0 // 2 + n // 2].tolist()
                got += high[r, head, g0 // 2 : g0 // 2 + n // 2].tolist()
            want = reference_levels(
                x[r, head].numpy(), scales[r, head].tolist(), hinv[head].numpy()
            )
            assert got == want, (r, head)
    for head, q in enumerate(queries):
        err = {
            name: paged_cache.dequantize_int4(rows_[:, head]) - x[:, head]
            for name, rows_ in (("weighted", weighted), ("plain", plain))
        }
        seen = {name: (e @ q.T).square().mean().item() for name, e in err.items()}
        squared = {name: e.square().mean().item() for name, e in err.items()}
        assert seen["weighted"] < 0.8 * seen["plain"], seen
        assert squared["weighted"] > squared["plain"], squared  # what it trades


def transformers_keys_and_queries(model_dir, ids: list[int]) -> list[tuple]:
    """Each layer's queries and keys after RoPE (and q/k norms), float32 transformers, at the
    positions after the skipped first ones: (queries [H, n, d], keys [G, n, d]) per layer."""
    seen = {}

    def recording(module, query, key, value, attention_mask, **kw):
        skip = calibration.SKIPPED_POSITIONS
        seen[module.layer_idx] = query[0, :, skip:].float(), key[0, :, skip:].float()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("recording", recording)
    ref = hf_model(model_dir)
    ref.set_attn_implementation("recording")
    with torch.no_grad():
        ref(torch.tensor([ids]))
    return [seen[i] for i in sorted(seen)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_each_layer_s_calibration_is_what_transformers_keys_and_queries_give(model_dirs, arch):
    """The engine's shifts and rounding factors (bf16 model, kernels) against transformers'
    float32 keys and queries over the same tokens: the shift within 1.5% of the largest
    mean (measured 0.4-0.8%: bf16 weights and keys; qwen3_moe: q/k norms before RoPE); the
    rounding factor within 2% of the one its queries give (our kernels' alone: the torch path,
    MOESERVE_BF16_KERNELS=0, rounds plainly)."""
    model_dir = model_dirs(arch)
    eng = engine(model_dir, kv_cache_dtype="int4")
    ids = calibration.calibration_ids(eng.tokenizer)
    assert len(ids) == calibration.CALIBRATION_TOKENS
    expected = transformers_keys_and_queries(model_dir, ids)
    layers = calibration.attention_layers(eng.executor.model)
    assert len(layers) == len(expected) == eng.args.num_layers
    g, d = eng.args.num_kv_heads, eng.args.head_dim
    for attn, (queries, keys) in zip(layers, expected):
        shift, hinv = attn.attn.key_shift, attn.attn.key_hinv
        assert shift.shape == (g, d)
        assert hinv.shape == (g, d, d) if eng.executor.kernels else hinv is None
        mean = keys.mean(dim=1)
        largest = float(mean.abs().max())
        assert largest > 0.02
        torch.testing.assert_close(shift, mean, rtol=0, atol=0.015 * largest)
        if hinv is None:
            continue
        per_kv_head = rotate(queries).view(g, -1, queries.shape[1], d).reshape(g, -1, d)
        for head in range(g):
            want = calibration.rounding_factor(per_kv_head[head])
            scale = float(want.abs().max())
            torch.testing.assert_close(hinv[head], want, rtol=0, atol=0.02 * scale)
            assert not torch.allclose(want, torch.eye(d), atol=0.1 * scale)


def test_the_calibration_text_is_python_s_license():
    text = calibration.calibration_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in text and len(text) > 5000


def test_softmax_does_not_see_the_shift(model_dirs, monkeypatch):
    """A bf16 cache shifted as the int4 one is (its calibrated means plus 3 in every channel:
    scores move by q . m for every position alike) serves the unshifted engine's prompt
    logprobs and greedy tokens: prompts in chunks of 8 reading their cached prefix, a prefix
    hit, then decode steps on the fused step; within bf16's rounding of k - m. The cache does
    hold the shifted keys."""
    model_dir = model_dirs("mixtral")
    options = {"enable_prefix_caching": True, "kv_cache_tokens": 1024}
    plain = engine(model_dir, **options)
    monkeypatch.setattr(executor_module, "INT4", torch.bfloat16)  # calibrate this bf16 cache
    shifted = engine(model_dir, **options)
    layers = calibration.attention_layers(shifted.executor.model)
    assert layers and (shifted.executor.fused_step is not None) == shifted.executor.kernels
    for attn in layers:
        attn.attn.key_shift.add_(3.0)  # in place: the fused step reads it by address
    batch = prompts(shifted.args.vocab_size, [40, 33])
    error = prompt_logprobs(shifted, batch) - prompt_logprobs(plain, batch)
    assert error.abs().mean().item() < 0.01, error.abs().mean().item()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prefix_hit = [batch[0] + batch[1][:5]]
    [ours] = shifted.generate(prefix_hit, params)
    [theirs] = plain.generate(prefix_hit, params)
    assert ours.num_cached_tokens == theirs.num_cached_tokens > 0
    assert ours.token_ids == theirs.token_ids
    mine = torch.tensor([lp.logprob for lp in ours.outputs[0].logprobs])
    other = torch.tensor([lp.logprob for lp in theirs.outputs[0].logprobs])
    assert (mine - other).abs().max().item() < 0.05
    # both engines placed the same requests in the same slots: where the plain one wrote a
    # key, the shifted one holds that key less m
    theirs_k = plain.executor.kv_caches[0][0].float()
    ours_k = shifted.executor.kv_caches[0][0].float()
    written = theirs_k.abs().amax(dim=(1, 2)) > 0
    assert written.sum() >= 45
    m = layers[0].attn.key_shift
    gap = theirs_k[written] - ours_k[written] - m
    assert gap.abs().mean().item() < 0.02, gap.abs().mean().item()


def test_sinks_keep_their_keys_unshifted_and_mla_is_left_alone(model_dirs):
    """gpt-oss's sinks would not move with shifted scores (its keys still round by their
    queries); MLA's latent is no key."""
    oss = engine(model_dirs("gpt_oss"), kv_cache_dtype="int4")
    layers = calibration.attention_layers(oss.executor.model)
    assert layers and all(a.attn.key_shift is None for a in layers)
    if oss.executor.kernels:
        assert all(not torch.equal(a.attn.key_hinv[0], torch.eye(a.head_dim)) for a in layers)
    mla = engine(model_dirs("deepseek_v2"), kv_cache_dtype="int4")
    assert calibration.attention_layers(mla.executor.model) == []
    for m in mla.executor.model.modules():
        assert getattr(m, "key_shift", None) is None and getattr(m, "key_hinv", None) is None


def test_the_switches_turn_each_off_and_refuse_other_values(model_dirs, monkeypatch):
    """MOESERVE_KV_KEY_SHIFT and MOESERVE_KV_KEY_ROUNDING, each alone; the torch path rounds
    plainly; a bf16 cache has neither."""
    model_dir = model_dirs("mixtral")

    def calibrated(eng) -> tuple[bool, bool]:
        layers = calibration.attention_layers(eng.executor.model)
        return (
            all(a.attn.key_shift is not None for a in layers),
            all(a.attn.key_hinv is not None for a in layers),
        )

    first = engine(model_dir, kv_cache_dtype="int4")
    kernels = first.executor.kernels  # the rounding is our kernels' alone
    assert calibrated(first) == (True, kernels)
    monkeypatch.setenv("MOESERVE_KV_KEY_SHIFT", "0")
    assert calibrated(engine(model_dir, kv_cache_dtype="int4")) == (False, kernels)
    monkeypatch.setenv("MOESERVE_KV_KEY_ROUNDING", "0")
    eng = engine(model_dir, kv_cache_dtype="int4")
    assert all(
        a.attn.key_shift is None and a.attn.key_hinv is None
        for a in calibration.attention_layers(eng.executor.model)
    )
    monkeypatch.setenv("MOESERVE_KV_KEY_SHIFT", "1")
    assert calibrated(engine(model_dir, kv_cache_dtype="int4")) == (True, False)
    monkeypatch.setenv("MOESERVE_KV_KEY_ROUNDING", "yes")
    with pytest.raises(ValueError, match="MOESERVE_KV_KEY_ROUNDING=yes"):
        engine(model_dir, kv_cache_dtype="int4")
    monkeypatch.delenv("MOESERVE_KV_KEY_ROUNDING")
    monkeypatch.delenv("MOESERVE_KV_KEY_SHIFT")
    try:  # torch's path: the shift alone (its rounding loop would cost each write ms)
        cpu_kernels.enable(None)
        assert calibrated(engine(model_dir, kv_cache_dtype="int4")) == (True, False)
    finally:
        cpu_kernels.enable()
    plain = engine(model_dir)  # a bf16 cache: neither
    assert all(
        a.attn.key_shift is None and a.attn.key_hinv is None
        for a in calibration.attention_layers(plain.executor.model)
    )
