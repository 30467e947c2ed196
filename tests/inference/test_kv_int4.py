"""The int4 KV cache (--kv-cache-dtype int4, issue 40): rows rotated as the 8-bit cache's, two
values a byte with a bf16 scale per 32 values (models/paged_cache.py). Its torch writer and
reader against a reference written out value by value; the C kernels' writer (the rope
kernel, the one-call decode step's) byte for byte against torch, and decode attention
reading the rows in place, on every path this CPU can run (AVX-512 with and without AMX,
AVX-512-BF16, AVX2, the emulated builds); the torch path (kernels off) against the kernels;
the engine's capacity in the same bytes; prompts prefilled in chunks of 8 tokens, so every
chunk reads the cache back, staying close to bf16; prefix hits and preemption on it; and the
errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from inference import SamplingParams
from inference.errors import InvalidParameterError
from inference.executor import kv_cache as kv_alloc
from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache as kv_cache
from inference.quantization import hadamard
from tests.inference.kernel_paths import Path, forced
from tests.inference.parity_checks import prompts
from tests.inference.test_cpu_kernels import (  # noqa: F401 (the fixtures)
    arch_dirs,
    attention_reference,
    close_to_bf16,
    close_to_int4_attention,
    path,
    randn,
)
from tests.inference.test_quant_kernels import mla_args
from tests.inference.test_quantization import engine, prompt_logprobs

GROUP = 32


def reference_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, d] -> (the row bytes [n, d / 2 + 2 * groups], the values they stand for, still
    rotated), one group and one value at a time: rotate; for each candidate scale
    bf16(amax * f / 7), f in INT4_SCALE_FACTORS, q = round-half-even(clamp(x / scale, -8, 7))
    and the squared error; the first candidate with the least error kept; byte i of a group of
    m holding q_i + 8 low and q_(i + m/2) + 8 high, the groups' scales after the values."""
    x = hadamard.rotate(x.float())
    n, d = x.shape
    packed = torch.zeros(n, d // 2, dtype=torch.uint8)
    scales = torch.zeros(n, -(-d // GROUP), dtype=torch.bfloat16)
    values = torch.zeros(n, d)
    for r in range(n):
        for j, g in enumerate(range(0, d, GROUP)):
            m = min(GROUP, d - g)
            amax = x[r, g : g + m].abs().max()
            best = None
            for f in kv_cache.INT4_SCALE_FACTORS:
                s = (amax * f / 7).to(torch.bfloat16)
                levels = [
                    0 if s == 0 else int(torch.round((x[r, g + i] / s.float()).clamp(-8, 7)))
                    for i in range(m)
                ]
                err = sum((q * float(s) - float(x[r, g + i])) ** 2 for i, q in enumerate(levels))
                if best is None or err < best[0]:
                    best = err, s, levels
            _, s, levels = best
            scales[r, j] = s
            for i, q in enumerate(levels):
                values[r, g + i] = q * s.float()
                nibble = (q + 8) << 4 if i >= m // 2 else q + 8
                packed[r, g // 2 + i % (m // 2)] |= nibble
    return torch.cat((packed, scales.view(torch.uint8)), dim=-1), values


def int4_cache(slots: int, heads: int, width: int) -> torch.Tensor:
    width = kv_cache.row_width(width, kv_cache.INT4)
    return torch.zeros(slots, heads, width, dtype=torch.uint8).view(kv_cache.INT4)


# ---- the format, in torch ----------------------------------------------------------------


@pytest.mark.parametrize("width", [64, 128, 80, 20, 576])
def test_torch_writes_and_reads_int4_rows_as_the_reference_does(width):
    """Whole groups (64, 128, MLA's 576), a shorter last group (80 = 32 + 32 + 16) and a row
    shorter than a group (20); values spanning six orders of magnitude, and a zero row."""
    x = randn(6, width, seed=width) * torch.logspace(-3, 3, width).bfloat16()
    x[2] = 0
    expected_bytes, expected_values = reference_rows(x)
    cache = int4_cache(6, 1, width)
    kv_cache.write_kv(cache, torch.arange(6), x.unsqueeze(1))
    assert kv_cache.kv_width(cache) == width
    assert torch.equal(cache.view(torch.uint8)[:, 0], expected_bytes)
    torch.testing.assert_close(
        kv_cache.dequantize_int4(cache.view(torch.uint8)[:, 0]), expected_values, rtol=0, atol=0
    )
    back = kv_cache.dequantize(cache, torch.float32)[:, 0]  # rotated back, by a matrix product
    expected = hadamard.rotate(expected_values)
    torch.testing.assert_close(back, expected, rtol=1e-5, atol=float(expected.abs().max()) * 1e-6)


def test_int4_rows_hold_each_group_no_worse_than_its_amax_scale_would():
    """The scale search never loses to amax / 7 (every value within half a step), and it
    takes a smaller scale for most groups of Gaussian values."""
    x = randn(50, 4, 64, seed=9)
    cache = int4_cache(50, 4, 64)
    kv_cache.write_kv(cache, torch.arange(50), x)
    rotated = hadamard.rotate(x.float()).unflatten(-1, (2, GROUP))
    back = hadamard.rotate(kv_cache.dequantize(cache, torch.float32)).unflatten(-1, (2, GROUP))
    step = (rotated.abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    plain = (rotated / step).clamp(-7, 7).round() * step
    error = (back - rotated).square().sum(-1)
    assert error.le((plain - rotated).square().sum(-1) * (1 + 1e-5) + 1e-9).all()
    scales = kv_cache.quantize_int4(x)[..., 32:].contiguous().view(torch.bfloat16).float()
    assert scales.lt(step.squeeze(-1)).float().mean() > 0.5
    assert F.cosine_similarity(back.flatten(), rotated.flatten(), dim=0) > 0.99


# ---- the kernels, on every path ----------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 20])
def test_the_rope_kernel_writes_int4_rows_as_torch_does(path, d):  # noqa: F811
    t, h, g = 9, 4, 2
    qkv = (torch.randn(t, h + 2 * g, d) * torch.logspace(-4, 4, d)).bfloat16()
    cos, sin = torch.ones(t, d).bfloat16(), torch.zeros(t, d).bfloat16()  # rope is the identity
    slots = torch.tensor([3, 0, 7, 12, 5, 1, 9, 2, 14])
    kc, vc = int4_cache(16, g, d), int4_cache(16, g, d)
    cpu_kernels.rope_and_cache(qkv.clone(), cos, sin, h, g, slots, kc, vc)
    rk, rv = int4_cache(16, g, d), int4_cache(16, g, d)
    kv_cache.write_kv(rk, slots, qkv[:, h : h + g])
    kv_cache.write_kv(rv, slots, qkv[:, h + g :])
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def source_rows(slots: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 keys and values decoded_over_int4_rows writes into its int4 caches."""
    return randn(slots, kv_heads, dim, seed=7), randn(slots, kv_heads, dim, seed=8)


def decoded_over_int4_rows(heads, kv_heads, dim, lengths, bs, nblocks, table_width):
    """Decode attention of random queries over int4 caches of source_rows, each sequence's
    block table `table_width` shuffled blocks: (q, k cache, v cache, tables, output)."""
    kc, vc = int4_cache(nblocks * bs, kv_heads, dim), int4_cache(nblocks * bs, kv_heads, dim)
    k0, v0 = source_rows(nblocks * bs, kv_heads, dim)
    kv_cache.write_kv(kc, torch.arange(nblocks * bs), k0)
    kv_cache.write_kv(vc, torch.arange(nblocks * bs), v0)
    g = torch.Generator().manual_seed(2)
    perms = [torch.randperm(nblocks, generator=g)[:table_width] for _ in lengths]
    tables = torch.stack(perms).int()
    q = randn(len(lengths), heads, dim, seed=3)
    out = cpu_kernels.decode_attention(
        q, kc, vc, tables, torch.tensor(lengths, dtype=torch.int32), bs, dim**-0.5
    )
    return q, kc, vc, tables, out


@pytest.mark.parametrize(
    "heads,kv_heads,dim,lengths",
    [
        (8, 2, 64, [5, 70, 200]),  # two whole groups a row, grouped-query heads
        (4, 4, 128, [1, 33]),
        (6, 2, 80, [17, 300]),  # a shorter last group (16)
        (4, 2, 20, [40]),  # a row shorter than a group
    ],
)
def test_decode_attention_reads_int4_rows_in_place(path, heads, kv_heads, dim, lengths):  # noqa: F811
    bs, nblocks = 16, 20
    q, kc, vc, tables, out = decoded_over_int4_rows(
        heads, kv_heads, dim, lengths, bs, nblocks, table_width=19
    )
    # against float32 attention over the rows as the reference reads them
    kf, vf = kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)
    for b, n in enumerate(lengths):
        close_to_int4_attention(
            out[b], attention_reference(q[b], kf, vf, tables[b], n, bs, dim**-0.5)
        )


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128)])
def test_the_kernel_s_rounding_is_a_small_share_of_the_int4_rows_own_error(
    path,  # noqa: F811
    heads,
    kv_heads,
    dim,
):
    """Its int8 query and 8-bit weights (close_to_int4_attention) against what int4 rows cost
    anyway: the kernel's distance from attention over the rows' values is under a fifth of
    those values' distance from attention over the bf16 keys and values they were made from
    (measured 2-11% on these shapes)."""
    bs, nblocks, lengths = 16, 80, [5, 70, 200, 1000]
    q, kc, vc, tables, out = decoded_over_int4_rows(
        heads, kv_heads, dim, lengths, bs, nblocks, table_width=64
    )
    k0, v0 = source_rows(nblocks * bs, kv_heads, dim)
    kf, vf = kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)
    for b, n in enumerate(lengths):
        rows = attention_reference(q[b], kf, vf, tables[b], n, bs, dim**-0.5)
        made_from = attention_reference(q[b], k0, v0, tables[b], n, bs, dim**-0.5)
        kernel = (out[b].float() - rows).abs().max()
        assert kernel < 0.2 * (rows - made_from).abs().max(), (n, float(kernel))


def latent_attention(r: int, p: int):
    """Decode attention of 16 heads over one int4 latent row of r + p values (MLA's: keys
    whole, values its first r), two sequences: (q, cache, tables, lengths, output)."""
    cache = int4_cache(320, 1, r + p)
    kv_cache.write_kv(cache, torch.arange(320), randn(320, 1, r + p, seed=4))
    tables = torch.arange(20, dtype=torch.int32).flip(0).view(2, 10)
    q = randn(2, 16, r + p, seed=5)
    lengths = torch.tensor([150, 9], dtype=torch.int32)
    out = cpu_kernels.decode_attention(q, cache, cache, tables, lengths, 16, 0.1, v_dim=r)
    return q, cache, tables, lengths, out


def test_avx2_sums_the_int4_products_the_vnni_build_sums():
    """AVX2's vpmaddubsw (int16 sums widened once a step or chunk) and the avx512bf16 build's
    vpdpbusd (on SIMDe here) take the same integer products of the same int8 query and 8-bit
    weights: their outputs differ only where float32 parts add in another order, within one
    bf16 rounding (measured 1/4000 of the largest output), where widening the rows to
    float32 instead (the avx512 build) lands 1/130 away."""
    runs = {}
    for p in (Path("avx2"), Path("avx512bf16", emulated=True)):
        with forced(p):
            grouped = [
                decoded_over_int4_rows(h, g, d, [5, 70, 200, 1000], 16, 80, 64)[-1]
                for h, g, d in [(8, 2, 64), (4, 4, 128), (9, 3, 64)]
            ]
            runs[str(p)] = [*grouped, latent_attention(128, 64)[-1]]  # MLA: keys 192, values 128
    for avx2, vnni in zip(runs["avx2"], runs["avx512bf16-emulated"], strict=True):
        close_to_bf16(avx2, vnni.float())


def test_the_avx512_build_reads_int4_rows_on_vnni_where_the_cpu_has_it():
    """The avx512 build (the AMX Xeons', Skylake-X's) holds decode attention twice. On a CPU
    with VNNI, its copy built with it takes every call: int4 rows go through the avx512bf16
    build's integer products, to the bit (natively where this CPU runs both builds, else on
    SIMDe). With vnni=False (Skylake-X has none), the rows widen to float32 and land as
    close to attention over their values as bf16 rounding allows."""
    native = {"avx512bf16", "avx512"} <= set(cpu_kernels.runnable_isas())
    shapes = [(8, 2, 64), (4, 4, 128), (9, 3, 64)]
    runs = {}
    for isa in ("avx512bf16", "avx512"):
        with forced(Path(isa, emulated=not native)):
            assert cpu_kernels.paths()["decode_attention"] == (
                "avx512+vnni" if isa == "avx512" else isa
            )
            runs[isa] = [
                decoded_over_int4_rows(h, g, d, [5, 70, 200, 1000], 16, 80, 64)
                for h, g, d in shapes
            ]
    for vnni, bf16_build in zip(runs["avx512"], runs["avx512bf16"], strict=True):
        assert torch.equal(vnni[-1], bf16_build[-1])
    try:
        cpu_kernels.enable("avx512", vnni=False, emulated=not native)
        assert cpu_kernels.paths()["decode_attention"] == "avx512"
        for h, g, d in shapes:
            q, kc, vc, tables, out = decoded_over_int4_rows(h, g, d, [5, 70, 200], 16, 80, 64)
            kf, vf = kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)
            for b, n in enumerate([5, 70, 200]):
                close_to_bf16(out[b], attention_reference(q[b], kf, vf, tables[b], n, 16, d**-0.5))
    finally:
        cpu_kernels.enable()


@pytest.mark.parametrize(
    "r,p,close",
    [
        (64, 16, close_to_bf16),  # 80 wide: rows widened to float32
        (128, 64, close_to_int4_attention),  # whole steps of 64: integer products where built
    ],
)
def test_an_int4_latent_cache_reads_its_values_and_scales_as_mla_does(path, r, p, close):  # noqa: F811
    """MLA's one latent row of r + p values, read as keys whole and as values its first r
    (whole groups: 64 of 80, the rope part's 16 a shorter last group)."""
    q, cache, tables, lengths, out = latent_attention(r, p)
    values = kv_cache.dequantize(cache, torch.float32)
    for b in range(2):
        expected = attention_reference(
            q[b], values, values, tables[b], int(lengths[b]), 16, 0.1, v_dim=r
        )
        close(out[b], expected)


@pytest.mark.parametrize("rank,rope,ok", [(512, 64, True), (64, 16, True), (16, 8, False)])
def test_an_int4_cache_refuses_an_mla_latent_whose_values_are_no_whole_groups(rank, rope, ok):
    """16 of 24 rotate alone (the 8-bit cache takes them) but are half a scale group."""
    args = mla_args(rank, rope)
    assert kv_alloc.allocate_kv_cache(args, 1, 16, torch.uint8, torch.device("cpu"))
    if ok:
        assert kv_alloc.allocate_kv_cache(args, 1, 16, kv_cache.INT4, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="groups of 32"):
            kv_alloc.allocate_kv_cache(args, 1, 16, kv_cache.INT4, torch.device("cpu"))


# ---- in the engine -----------------------------------------------------------------------


def test_an_int4_cache_holds_3_5x_the_tokens_of_bf16_in_the_same_bytes(model_dirs):
    """Rows of d values take d / 2 bytes and a 2-byte scale per 32: 2d / (d/2 + d/16) = 3.56x
    at head widths of 64 (SmolLM2, the small demo model) and 128; 3.2x at this test model's
    16 (one shorter group)."""
    model = model_dirs("mixtral")
    budget = 1 << 22
    plain = engine(model, kv_cache_tokens=None, kv_cache_bytes=budget)
    small = engine(model, kv_cache_tokens=None, kv_cache_bytes=budget, kv_cache_dtype="int4")
    assert small.kv_cache_dtype == "int4" and small.kv_cache_bytes <= budget
    assert small.executor.kv_caches[0][0].dtype == kv_cache.INT4
    d = plain.args.head_dim
    expected = 2 * d / (d // 2 + 2 * -(-d // GROUP))
    assert small.kv_cache_tokens / plain.kv_cache_tokens == pytest.approx(expected, rel=0.01)
    assert small.block_manager.num_blocks > 3 * plain.block_manager.num_blocks
    for width in (64, 128):
        args = dataclasses.replace(plain.args, head_dim=width)
        ratio = kv_alloc.kv_bytes_per_token(args, torch.bfloat16) / kv_alloc.kv_bytes_per_token(
            args, kv_cache.INT4
        )
        assert ratio >= 3.5


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2", "llama"])
def test_chunked_prompts_reading_an_int4_cache_stay_close_to_bf16(arch_dirs, arch):  # noqa: F811
    """Mean |d logprob| per prompt token against the bf16 cache, prompts prefilled 8 tokens a
    chunk (each chunk attends to the earlier ones as stored), on random-weight models whose
    logprobs average about -8.8: measured 0.040-0.061 (mixtral, deepseek_v2's MLA latent,
    qwen2_moe; int8's 0.006-0.009), bound about twice that."""
    model = arch_dirs(arch)
    base = engine(model)
    batch = prompts(base.args.vocab_size, [40, 33])
    error = prompt_logprobs(engine(model, kv_cache_dtype="int4"), batch) - prompt_logprobs(
        base, batch
    )
    assert error.abs().mean().item() < 0.12, (arch, error.abs().mean().item())


def test_the_torch_path_reads_and_writes_what_the_kernels_do(model_dirs, monkeypatch):
    """CPUs without our kernels (and CUDA) write and read the int4 cache in torch
    (paged_cache.write_kv, gather_slots): the same rows, so nearly the same logprobs; the
    AVX2 build likewise. (The keys' calibrated rounding is the kernels' alone: off here, so
    both write the same rows.)"""
    monkeypatch.setenv("MOESERVE_KV_KEY_ROUNDING", "0")
    model = model_dirs("qwen2_moe")
    batch = prompts(1000, [30])
    kernels = prompt_logprobs(engine(model, kv_cache_dtype="int4"), batch)
    try:
        cpu_kernels.enable(None)
        torch_path = engine(model, kv_cache_dtype="int4")
        assert not torch_path.runner.paged_kernel
        ours = prompt_logprobs(torch_path, batch)
        if "avx2" in cpu_kernels.runnable_isas():
            cpu_kernels.enable("avx2")
            avx2 = prompt_logprobs(engine(model, kv_cache_dtype="int4"), batch)
            assert (avx2 - kernels).abs().mean().item() < 0.02
    finally:
        cpu_kernels.enable()
    assert (ours - kernels).abs().mean().item() < 0.02


def test_prefix_caching_and_preemption_work_on_an_int4_cache(model_dirs):
    """A batch sharing a 32-token prefix through a cache far too small for it (preemptions):
    every request completes, every block comes back, and each token it chose is what a roomy
    int4 cache ranks top (or within a near-tie: these random models' logits are nearly
    flat). The prefix is then served from the cache, and a request after it decodes what
    the same request does without the hit, within the same near-ties."""
    model = model_dirs("mixtral")
    prefix = prompts(1000, [32])[0]
    batch = [prefix + tail for tail in prompts(1000, [5, 9, 14, 20])]
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
    tight = engine(
        model,
        kv_cache_dtype="int4",
        kv_cache_tokens=96,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    preempted = []
    tight.scheduler.on_preempt = preempted.append
    outs = tight.generate(batch, params)
    assert preempted and all(o.finish_reason == "length" for o in outs)
    assert tight.block_manager.num_used == 0  # every block back
    roomy = engine(model, kv_cache_dtype="int4", kv_cache_tokens=2048)
    scored = roomy.generate(
        [p + o.token_ids for p, o in zip(batch, outs)],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
    )
    for prompt, out in zip(batch, scored):
        for lp in out.prompt_logprobs[len(prompt) :]:
            assert lp.logprob >= lp.top[0].logprob - 0.25, (lp.logprob, lp.top[0].logprob)
    cached = engine(model, kv_cache_dtype="int4", kv_cache_tokens=2048, enable_prefix_caching=True)
    cached.generate([batch[0]], params)
    [again] = cached.generate([batch[1]], params)
    assert again.num_cached_tokens == 32
    [fresh] = roomy.generate([batch[1]], params)
    rescored = roomy.generate(
        [batch[1] + again.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )[0]
    assert again.token_ids[:4] == fresh.token_ids[:4]
    for lp in rescored.prompt_logprobs[len(batch[1]) :]:
        assert lp.logprob >= lp.top[0].logprob - 0.25


@pytest.mark.parametrize("value", ["int3", "uint4", "INT4"])
def test_bad_kv_cache_dtypes_are_clear_errors(model_dirs, value):
    with pytest.raises(InvalidParameterError) as err:
        engine(model_dirs("mixtral"), kv_cache_dtype=value)
    assert err.value.param == "kv_cache_dtype" and "int4" in str(err.value)


def test_an_int4_cache_refuses_rows_of_an_odd_width():
    args = dataclasses.replace(mla_args(64, 16), kv_lora_rank=0, head_dim=15)
    with pytest.raises(ValueError, match="odd width"):
        kv_alloc.allocate_kv_cache(args, 1, 16, kv_cache.INT4, torch.device("cpu"))
