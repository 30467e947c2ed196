"""The int4 cache's key shift (inference/executor/key_shift.py): keys less their mean per layer
and kv head, measured at load. The rope kernel takes it off as torch does, on every kernel
path, before the int4 rows are written; the shift is the mean transformers' own keys give
over the calibration text; softmax does not see it (a bf16 cache shifted by a large m serves
the unshifted logprobs through chunked prefill, prefix hits and the fused decode step); the
layers it must not touch (sinks, MLA) keep their keys; and its switch."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inference import SamplingParams
from inference.executor import executor as executor_module
from inference.executor import key_shift
from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache
from inference.models.attention import AttentionMetadata, PagedAttention
from inference.models.layers import apply_rope
from tests.inference.parity_checks import hf_model, prompts
from tests.inference.test_cpu_kernels import path, randn  # noqa: F401 (the fixture)
from tests.inference.test_kv_int4 import int4_cache
from tests.inference.test_quantization import engine, prompt_logprobs


def shifted_keys(qkv, cos, sin, h, g, m):
    """The reference: keys after RoPE, less m, rounded to bf16 once."""
    return (apply_rope(qkv[:, : h + g], cos, sin)[:, h:].float() - m).bfloat16()


@pytest.mark.parametrize("storage", ["int4", "bf16"])
def test_the_rope_kernel_takes_the_shift_off_as_torch_does(path, storage):  # noqa: F811
    """The kernel's keys (returned in place) and cache rows equal torch's: PagedAttention's
    rope_and_write, and the reference above written by paged_cache.write_kv."""
    t, h, g, d = 19, 4, 2, 64  # 19 rows: the threaded loop too
    qkv = randn(t, h + 2 * g, d)
    cos, sin = randn(t, 1, d, seed=1), randn(t, 1, d, seed=2)
    m = torch.randn(g, d, generator=torch.Generator().manual_seed(3)) * 4
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:t]

    def caches():
        if storage == "int4":
            return int4_cache(32, g, d), int4_cache(32, g, d)
        return torch.zeros(32, g, d, dtype=torch.bfloat16), torch.zeros(
            32, g, d, dtype=torch.bfloat16
        )

    expected = shifted_keys(qkv, cos, sin, h, g, m)
    ours, (kc, vc) = qkv.clone(), caches()
    cpu_kernels.rope_and_cache(ours, cos, sin, h, g, slots, kc, vc, m)
    assert torch.equal(ours[:, h : h + g], expected)
    assert torch.equal(ours[:, h + g :], qkv[:, h + g :])  # values as they were
    rk, rv = caches()
    paged_cache.write_kv(rk, slots, expected)
    paged_cache.write_kv(rv, slots, qkv[:, h + g :])
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))

    plain = PagedAttention(h, g, 1.0)
    plain.key_shift = m
    meta = AttentionMetadata(slots, 0, None, None, [])
    tk, tv = caches()
    _, k, _ = plain.rope_and_write(qkv, cos, sin, meta, tk, tv)
    assert torch.equal(k, expected)
    assert torch.equal(tk.view(torch.uint8), rk.view(torch.uint8))
    with pytest.raises(ValueError, match="key shift"):
        cpu_kernels.rope_and_cache(qkv.clone(), cos, sin, h, g, slots, kc, vc, m[:, :32])


def transformers_key_means(model_dir, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's keys after RoPE (and q/k norms), float32 transformers, averaged over the
    positions after the skipped first ones -> [G, d] per layer."""
    means = {}

    def recording(module, query, key, value, attention_mask, **kw):
        means[module.layer_idx] = key[0, :, key_shift.SKIPPED_POSITIONS :].float().mean(dim=1)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("key_means", recording)
    ref = hf_model(model_dir)
    ref.set_attn_implementation("key_means")
    with torch.no_grad():
        ref(torch.tensor([ids]))
    return [means[i] for i in sorted(means)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_each_layer_s_shift_is_its_mean_key_over_the_calibration_text(model_dirs, arch):
    """The engine's shifts (bf16 model, kernels) against transformers' float32 keys over the
    same tokens, within 1.5% of the largest (bf16 weights and keys; qwen3_moe: q/k norms
    before RoPE)."""
    model_dir = model_dirs(arch)
    eng = engine(model_dir, kv_cache_dtype="int4")
    ids = key_shift.calibration_ids(eng.tokenizer)
    assert len(ids) == key_shift.CALIBRATION_TOKENS
    expected = transformers_key_means(model_dir, ids)
    layers = key_shift.shifted_layers(eng.executor.model)
    assert len(layers) == len(expected) == eng.args.num_layers
    for attn, mean in zip(layers, expected):
        shift = attn.attn.key_shift
        assert shift.shape == (eng.args.num_kv_heads, eng.args.head_dim)
        # measured: 0.4% (mixtral) to 0.4-0.8% (qwen3_moe) of the largest mean's size
        largest = float(mean.abs().max())
        assert largest > 0.02
        torch.testing.assert_close(shift, mean, rtol=0, atol=0.015 * largest)


def test_the_calibration_text_is_python_s_license():
    text = key_shift.calibration_text()
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
    monkeypatch.setattr(executor_module, "INT4", torch.bfloat16)  # shift this bf16 cache
    shifted = engine(model_dir, **options)
    layers = key_shift.shifted_layers(shifted.executor.model)
    assert layers and shifted.executor.fused_step is not None
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


def test_layers_with_sinks_or_a_latent_keep_their_keys(model_dirs):
    """gpt-oss's sinks would not move with the shifted scores; MLA's latent is no key."""
    for arch in ("gpt_oss", "deepseek_v2"):
        eng = engine(model_dirs(arch), kv_cache_dtype="int4")
        assert key_shift.shifted_layers(eng.executor.model) == []
        assert all(getattr(m, "key_shift", None) is None for m in eng.executor.model.modules())


def test_the_switch_turns_it_off_and_refuses_other_values(model_dirs, monkeypatch):
    monkeypatch.setenv("MOESERVE_KV_KEY_SHIFT", "0")
    eng = engine(model_dirs("mixtral"), kv_cache_dtype="int4")
    assert all(a.attn.key_shift is None for a in key_shift.shifted_layers(eng.executor.model))
    monkeypatch.setenv("MOESERVE_KV_KEY_SHIFT", "yes")
    with pytest.raises(ValueError, match="MOESERVE_KV_KEY_SHIFT=yes"):
        engine(model_dirs("mixtral"), kv_cache_dtype="int4")
    monkeypatch.delenv("MOESERVE_KV_KEY_SHIFT")
    plain = engine(model_dirs("mixtral"))  # bf16 cache: never shifted
    assert all(a.attn.key_shift is None for a in key_shift.shifted_layers(plain.executor.model))
