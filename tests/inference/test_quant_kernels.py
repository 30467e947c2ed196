"""The 8-bit kernels (csrc/gemm8.c, int8_vnni.c, amx.c's int8 tiles): int8 weights (W8A8)
against the exact integer arithmetic of quantization/qweight.py's torch path, fp8 weights and 8-bit KV-cache
rows against float32 arithmetic, on every path this CPU can run (tests/inference/
test_cpu_kernels.py's `path` fixture: native builds best first, then the emulated ones), with
VNNI on and off (vpmaddubsw's sequence instead). Paths the CPU lacks are skipped with the
reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.executor import kv_cache as kv_alloc
from inference.executor.quantize import QuantEmbedding
from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuQuantEmbedding
from inference.models import paged_cache as kv_cache
from inference.models.args import ModelArgs
from inference.models.moe import grouped_dispatch, select_experts
from inference.quantization import hadamard
from inference.quantization import qweight as quant
from tests.inference.test_cpu_kernels import (  # noqa: F401 (the fixture)
    attention_reference,
    close_to_bf16,
    path,
    randn,
)


@pytest.fixture(params=[True, False], ids=["vnni", "no-vnni"])
def int8_path(request, path):  # noqa: F811
    """`path` with the int8 products on VNNI where the CPU has it, and forced off it."""
    if not request.param:
        cpu_kernels.enable(path.isa, amx=path.amx, emulated=path.emulated, vnni=False)
    yield f"{path} int8={cpu_kernels.INT8}"


@pytest.fixture(params=[32, 0], ids=["act-per-32", "act-per-row"])
def int8_scales(request):
    """int8 activation scales per 32 inputs (MOESERVE_INT8_ACT_GROUP=32) or one a row (0, the
    default), the torch reference and the kernels alike; the start-up choice restored after."""
    before = quant.INT8_ACT_GROUP
    cpu_kernels.int8_act_group(request.param)
    yield request.param
    cpu_kernels.int8_act_group(before)


def int8_reference(x: torch.Tensor, qw: quant.QWeight) -> torch.Tensor:
    """W8A8 in float64: the rows rotated and quantized as the kernels do (hadamard.rotate and
    quant.quantize_row_groups: the same float32 operations), per group of
    quant.INT8_ACT_GROUP inputs (0: the whole row), each group's integer sums exact, scaled
    by the group's activation scale, summed, then times the column's weight scale."""
    rows = hadamard.rotate(x.float())
    group = quant.INT8_ACT_GROUP or rows.shape[-1]
    q, sx = quant.quantize_row_groups(rows, group)
    total = torch.zeros(x.shape[0], qw.out_features, dtype=torch.float64)
    for g, start in enumerate(range(0, rows.shape[-1], group)):
        part = slice(start, start + group)
        sums = q[:, part].long() @ qw.data[:, part].long().t()
        total += sums.double() * sx[:, g : g + 1].double()
    return total * qw.scale[0].double()


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 4000, 512),
        (1, 40, 70),
        (3, 17, 1),
        (5, 64, 510),
        (17, 96, 64),
        (32, 40, 128),
        (40, 33, 64),
        (64, 48, 256),
    ],
)
def test_int8_linear_matches_the_integer_arithmetic(int8_scales, int8_path, path, m, n, k):  # noqa: F811
    w, x, b = randn(n, k, scale=0.05), randn(m, k, seed=1), randn(n, seed=2)
    qw = quant.quantize_int8(w.float())
    packed = cpu_kernels.pack_qweight(qw)
    blocks = -(-n // 16)
    assert torch.equal(packed.colsum, F.pad(qw.data.int().sum(-1), (0, 16 * blocks - n)))
    exact = int8_reference(x, qw)
    # integer sums exact, then a few float32 roundings and one to bf16
    close_to_bf16(cpu_kernels.linear(x, packed), exact.float())
    close_to_bf16(cpu_kernels.linear(x, packed, b), (exact + b.double()).float())
    close_to_bf16(quant.linear(x, qw, b), (exact + b.double()).float())
    # every int8 path (AMX tiles, VNNI, vpmaddubsw) gives the same sums and, per group, the
    # same fused multiply-adds in the same order
    ours = cpu_kernels.linear(x, packed, b)
    cpu_kernels.enable(path.isa, amx=False, emulated=path.emulated, vnni=False)
    assert torch.equal(cpu_kernels.linear(x, packed, b), ours)


def test_int8_activation_scales_per_32_inputs_keep_a_quiet_group_s_precision():
    """A token whose inputs are large in one group of 32 and small in the others: one scale a
    row leaves the small ones a few levels of 127, a scale per group keeps them whole (the
    reason llama.cpp's Q8_0 blocks are 32 values)."""
    x = randn(8, 256, seed=31).float()
    x[:, :32] *= 50
    q, sx = quant.quantize_row_groups(x, 32)
    assert sx.shape == (8, 8) and q.shape == x.shape
    grouped = q.float() * sx.repeat_interleave(32, dim=-1)
    qr, sr = quant.quantize_rows(x)
    row = qr.float() * sr[:, None]
    quiet = slice(32, None)
    grouped_error = (grouped - x)[:, quiet].pow(2).mean()
    assert grouped_error < 0.01 * (row - x)[:, quiet].pow(2).mean()
    # the last group shorter where K is not a multiple of 32: its own scale, no padding in q
    q7, s7 = quant.quantize_row_groups(x[:, :70], 32)
    assert q7.shape == (8, 70) and s7.shape == (8, 3)
    assert torch.equal(s7[:, 2], x[:, 64:70].abs().amax(-1) / 127)


def test_an_int8_act_group_other_than_32_or_0_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MOESERVE_INT8_ACT_GROUP", "16")
    with pytest.raises(ValueError, match="MOESERVE_INT8_ACT_GROUP must be 32"):
        quant._int8_act_group()
    with pytest.raises(ValueError, match="32 inputs or 0"):
        cpu_kernels.int8_act_group(64)


def test_int8_products_need_no_offset_and_never_saturate(int8_scales, int8_path):
    """Rows of +-127 against weights of +-127 (after the rotation: each is the rotation of a
    sign pattern), the largest products a pair can make, equal signs included."""
    k, g = 256, torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (32, k), generator=g).float() * 2 - 1
    signs[0], signs[1, 1::2] = 1.0, -signs[1, 1::2]
    x = hadamard.rotate(signs[:20]).bfloat16()  # multiples of 1/16: exact in bf16
    w = hadamard.rotate(signs)
    qw = quant.quantize_int8(w)
    assert qw.data.abs().eq(127).all()
    out = cpu_kernels.linear(x, cpu_kernels.pack_qweight(qw))
    exact = signs[:20] @ signs.t()  # sums of +-1, up to 256 when the patterns are equal
    torch.testing.assert_close(out.float(), exact)


def test_rotated_int8_products_lose_less_when_a_few_channels_carry_the_activations():
    """Why int8 weights and activations are rotated: trained models' activations carry a few
    channels far larger than the rest, and one scale per token, set by them, leaves the rest
    a few levels of 127. Rotated, every value carries a share of them."""
    x = randn(64, 512, seed=21).float()
    x[:, :4] *= 60
    w = randn(256, 512, seed=22, scale=0.05).float()
    exact = x @ w.t()
    q, sx = quant.quantize_rows(x)  # the same per-token and per-channel scales, unrotated
    qw, sw = quant.quantize_rows(w)
    unrotated = (q.double() @ qw.double().t()) * sx.double().unsqueeze(-1) * sw.double()
    rotated = quant.linear(x, quant.quantize_int8(w))
    rotated_error = (rotated.double() - exact.double()).pow(2).mean()
    unrotated_error = (unrotated - exact.double()).pow(2).mean()
    assert rotated_error < 0.25 * unrotated_error


@pytest.mark.parametrize("d", [512, 576, 96, 7])
def test_int8_embedding_rows_come_back_as_the_torch_lookup_gives_them(path, d):  # noqa: F811
    """The kernel's lookup (dequantize, rotate back, round to bf16) gives the floats of
    hadamard.rotate; an id outside the table fails as torch's lookup does."""
    table = quant.quantize_int8(randn(300, d, seed=5).bfloat16())
    embed = CpuQuantEmbedding(QuantEmbedding(table, torch.bfloat16))
    ids = torch.tensor([[0, 299, 7, 7], [150, 3, 42, 1]])
    flat = ids.reshape(-1)
    rows = table.data[flat].float() * table.scale[0][flat].unsqueeze(-1)
    expected = hadamard.rotate(rows).bfloat16().view(2, 4, d)
    assert torch.equal(cpu_kernels.embed_int8(table, ids), expected)
    assert torch.equal(embed(ids), expected)
    with pytest.raises(IndexError):
        cpu_kernels.embed_int8(table, torch.tensor([300]))
    with pytest.raises(IndexError):
        cpu_kernels.embed_int8(table, torch.tensor([-1]))


@pytest.mark.parametrize("m,n,k", [(1, 300, 256), (4, 40, 130), (20, 64, 256), (50, 33, 512)])
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_linear_matches_float32_arithmetic(path, m, n, k, layout):  # noqa: F811
    w, x, b = randn(n, k, scale=0.05), randn(m, k, seed=1), randn(n, seed=2)
    qw = quant.quantize_fp8(w.float())
    if layout == "block":  # 128 x 128 blocks as the published checkpoints: per-row groups
        scales, group = quant.checkpoint_fp8_scales(
            torch.rand(-(-n // 128), -(-k // 128)) * 1e-3 + 1e-4, (n, k), inverse_block=True
        )
        qw = quant.QWeight("fp8", qw.data, scales.t().contiguous(), group, k)
    exact = x.float() @ qw.dequantize().t() + b.float()
    # many rows dequantize the block to bf16 first: one more rounding of each weight
    tolerance = 2**-7 if m < 16 else 2**-6
    out = cpu_kernels.linear(x, cpu_kernels.pack_qweight(qw), b).float()
    torch.testing.assert_close(out, exact, rtol=tolerance, atol=float(exact.abs().max()) * 2**-8)
    torch.testing.assert_close(quant.linear(x, qw, b).float(), exact, rtol=2**-7, atol=1e-2)


def test_fp8_scaled_mm_path_matches_weight_only():
    """The CUDA path (torch._scaled_mm on per-token fp8 activations), run on the CPU where
    torch implements it: within fp8's activation rounding of the weight-only product."""
    w, x = randn(64, 256, scale=0.05), randn(8, 256, seed=1)
    qw = quant.quantize_fp8(w.float())
    weight_only = quant.linear(x, qw, scaled_mm=False).float()
    scaled = quant.linear(x, qw, scaled_mm=True).float()
    torch.testing.assert_close(scaled, weight_only, rtol=0.1, atol=0.06 * weight_only.abs().max())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(
    "t,d,i,e,top_k",
    # the last: experts of 16-row tile groups and a tail, taking gate and up blocks in pairs
    [(1, 64, 128, 8, 2), (7, 70, 40, 4, 2), (40, 64, 64, 8, 2), (150, 128, 64, 4, 2)],
)
def test_moe_on_8bit_experts_matches_the_torch_path(int8_scales, int8_path, fmt, t, d, i, e, top_k):
    if fmt == "fp8" and not int8_scales:
        pytest.skip("fp8 runs weight-only: no activation scales (the other parameter covers it)")
    w13, w2, x = randn(e, 2 * i, d, scale=0.1), randn(e, d, i, scale=0.1, seed=1), randn(t, d)
    g = torch.Generator().manual_seed(t)
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), top_k, True)
    q13, q2 = quant.quantize(w13.float(), fmt), quant.quantize(w2.float(), fmt)
    out, counts = cpu_kernels.moe(
        x, cpu_kernels.pack_qweight(q13), cpu_kernels.pack_qweight(q2), ids, weights
    )
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=e).tolist()
    # the torch path sums the experts' weighted outputs in bf16: a rounding or two apart
    ref = grouped_dispatch(x, weights, ids, counts, q13, q2, quant.linear).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=float(ref.abs().max()) * 2**-6)


# ---- the KV cache's 8-bit rows ------------------------------------------------------------


def caches(fmt: str, slots: int, heads: int, width: int) -> torch.Tensor:
    storage = kv_cache.storage_dtype(fmt, torch.bfloat16)  # a byte each (int4: two values)
    width = kv_cache.row_width(width, storage)
    return torch.zeros(slots, heads, width, dtype=torch.uint8).view(storage)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_kernel_writes_8bit_rows_as_torch_does(path, fmt):  # noqa: F811
    """rope_and_cache's quantizing write against kv_cache.write_kv, byte for byte, over values
    spanning fp8's subnormals, normals and saturation."""
    t, h, g, d = 9, 4, 2, 64
    qkv = (torch.randn(t, h + 2 * g, d) * torch.logspace(-5, 5, d)).bfloat16()
    cos, sin = torch.ones(t, d).bfloat16(), torch.zeros(t, d).bfloat16()  # rope is the identity
    slots = torch.tensor([3, 0, 7, 12, 5, 1, 9, 2, 14])
    kc, vc = caches(fmt, 16, g, d), caches(fmt, 16, g, d)
    cpu_kernels.rope_and_cache(qkv.clone(), cos, sin, h, g, slots, kc, vc)
    rk, rv = caches(fmt, 16, g, d), caches(fmt, 16, g, d)
    kv_cache.write_kv(rk, slots, qkv[:, h : h + g])
    kv_cache.write_kv(rv, slots, qkv[:, h + g :])
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_attention_reads_8bit_rows_in_place(path, fmt):  # noqa: F811
    bs, nblocks, heads, kv_heads, dim = 16, 20, 8, 2, 64
    lengths = [5, 70, 200]
    kc, vc = caches(fmt, nblocks * bs, kv_heads, dim), caches(fmt, nblocks * bs, kv_heads, dim)
    every = torch.arange(nblocks * bs)
    kv_cache.write_kv(kc, every, randn(nblocks * bs, kv_heads, dim, seed=7))
    kv_cache.write_kv(vc, every, randn(nblocks * bs, kv_heads, dim, seed=8))
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:13] for _ in lengths]).int()
    q = randn(len(lengths), heads, dim, seed=3)
    out = cpu_kernels.decode_attention(
        q, kc, vc, tables, torch.tensor(lengths, dtype=torch.int32), bs, 0.125
    )
    # against float32 attention over the rows as torch dequantizes them
    kf, vf = kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)
    for b, n in enumerate(lengths):
        close_to_bf16(out[b], attention_reference(q[b], kf, vf, tables[b], n, bs, 0.125))


def test_an_int8_latent_cache_reads_its_values_and_scale_as_mla_does(path):  # noqa: F811
    bs, r, p = 16, 64, 16
    cache = caches("int8", 320, 1, r + p)
    kv_cache.write_kv(cache, torch.arange(320), randn(320, 1, r + p, seed=4))
    tables = torch.arange(20, dtype=torch.int32).flip(0).view(2, 10)
    q = randn(2, 16, r + p, seed=5)
    lengths = torch.tensor([150, 9], dtype=torch.int32)
    out = cpu_kernels.decode_attention(q, cache, cache, tables, lengths, bs, 0.1, v_dim=r)
    values = kv_cache.dequantize(cache, torch.float32)
    for b in range(2):
        expected = attention_reference(
            q[b], values, values, tables[b], int(lengths[b]), bs, 0.1, v_dim=r
        )
        close_to_bf16(out[b], expected)


def test_int8_rows_hold_their_rotated_values_within_a_step_of_their_scale():
    x = randn(50, 4, 64, seed=9)
    cache = caches("int8", 50, 4, 64)
    kv_cache.write_kv(cache, torch.arange(50), x)
    back = kv_cache.dequantize(cache, torch.float32)
    rotated = hadamard.rotate(x.float())  # what the row stores
    step = rotated.abs().amax(-1, keepdim=True) / 127
    assert (hadamard.rotate(back) - rotated).abs().le(step * 0.51 + 1e-6).all()
    assert F.cosine_similarity(back.flatten(), x.float().flatten(), dim=0) > 0.9999


@pytest.mark.parametrize("fmt,bits", [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_rows_keep_their_relative_precision_whatever_their_magnitude(fmt, bits):
    """The row's scale lifts small values out of fp8's subnormals: each (rotated) value
    comes back within half a step of its mantissa, rows of 1e-4 as rows of 1e2."""
    x = torch.cat([randn(20, 2, 64, seed=s) * m for s, m in enumerate((1e-4, 1.0, 1e2))])
    cache = caches(fmt, 60, 2, 64)
    kv_cache.write_kv(cache, torch.arange(60), x)
    back, exact = (
        hadamard.rotate(kv_cache.dequantize(cache, torch.float32)),
        hadamard.rotate(x.float()),
    )
    close = (back - exact).abs().le(exact.abs() * 2.0 ** -(bits + 1) * 1.01 + 1e-12)
    assert close.float().mean() > 0.99


def test_rotated_fp8_keys_score_closer_when_a_few_channels_carry_them():
    """Why 8-bit rows are stored rotated: keys whose size sits in a few channels (as trained
    models' keys do) and queries that read those channels. fp8's error is relative to each
    value, so unrotated those few large values carry most of the scores' error; rotated, the
    error spreads over all 64 and largely cancels in the dot products."""
    keys = randn(256, 1, 64, seed=11).float() * 0.1
    keys[..., :4] += randn(256, 1, 4, seed=12).float() * 8
    q = randn(64, seed=13).float()
    q[:4] *= 4
    cache = caches("fp8_e4m3", 256, 1, 64)
    kv_cache.write_kv(cache, torch.arange(256), keys)
    stored = kv_cache.dequantize(cache, torch.float32)
    scale = keys.abs().amax(-1, keepdim=True) / 448  # the same row scale, without the rotation
    unrotated = (keys / scale).to(torch.float8_e4m3fn).float() * scale
    exact = keys[:, 0] @ q
    rotated_error = (stored[:, 0] @ q - exact).pow(2).mean()
    unrotated_error = (unrotated[:, 0] @ q - exact).pow(2).mean()
    assert rotated_error < 0.5 * unrotated_error


def mla_args(rank: int, rope: int) -> ModelArgs:
    return ModelArgs(
        architecture="DeepseekV2ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=rank + rope,
        num_experts=0,
        top_k=0,
        moe_intermediate_size=0,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )


@pytest.mark.parametrize("rank,rope,ok", [(512, 64, True), (32, 16, True), (48, 16, False)])
def test_an_8bit_cache_refuses_an_mla_latent_whose_values_cannot_rotate_alone(rank, rope, ok):
    """Attention reads the latent's first `rank` values as its values, so they must form
    whole rotation blocks of the row (DeepSeek's 512 of 576 do)."""
    args = mla_args(rank, rope)
    cpu = torch.device("cpu")
    if ok:
        allocated = kv_alloc.allocate_kv_cache(args, 1, 16, torch.uint8, cpu)
        assert allocated[0][0].shape == (16, 1, rank + rope + 2)
    else:
        with pytest.raises(ValueError, match="cannot hold this model's MLA latent"):
            kv_alloc.allocate_kv_cache(args, 1, 16, torch.uint8, cpu)
