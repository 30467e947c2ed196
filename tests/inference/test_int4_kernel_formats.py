"""The 4-bit kernels (csrc/int4.c, issue 40) on weights as published formats give them, each
path this CPU runs forced (test_int4_kernels.int4_path): int4 with integer zero points
(GPTQ / AWQ / compressed-tensors asymmetric), groups of 32, 64, 128 inputs or one per channel,
unrotated (published) or rotated; and gpt-oss's mxfp4 (e2m1 codes looked up in registers,
e8m0 scales per 32). The linear kernel gives the torch reference's floats exactly; the MoE
kernel matches the torch path; the one-call decode step computes what the composed layers
do on models served in each format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.executor import cpu_backend
from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuExperts, CpuLinear
from inference.models.moe import grouped_dispatch, select_experts
from inference.quantization import qweight as quant
from tests.inference.test_int4 import engine
from tests.inference.test_int4_kernels import (
    INT4_PATHS,
    forced_int4_path,
    fused_step_equals_the_composed_layers,
    path_id,
)


@pytest.fixture(params=INT4_PATHS, ids=path_id)
def int4_path(request):
    yield from forced_int4_path(request.param)


def asymmetric_int4(w: torch.Tensor, group: int, rotated: bool = False) -> quant.QWeight:
    """A min-max asymmetric quantizer, as GPTQ's and compressed-tensors' asymmetric schemes
    store theirs: scale (max - min) / 15, an integer zero point, levels in [0, 15]."""
    w = quant.rotate_by_products(w) if rotated else w.float()
    k = w.shape[-1]
    group = min(group, k)
    g = -(-k // group)
    blocks = F.pad(w, (0, g * group - k)).unflatten(-1, (g, group))
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    levels = (blocks / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15)
    levels = levels.flatten(-2)[..., :k].to(torch.uint8)
    return quant.int4_from_levels(levels, scale, zero, group, rotated)


def mxfp4(w: torch.Tensor) -> quant.QWeight:
    """w as gpt-oss's MXFP4 blocks would hold it (the nearest e2m1 value of each input, a
    power-of-two scale per 32 that keeps the block's largest within 6), through
    mxfp4_from_blocks."""
    k = w.shape[-1]
    blocks = w.float().unflatten(-1, (k // 32, 32))
    e = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    e = e.clamp(-127, 127)
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    scaled = blocks / torch.exp2(e).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - values).abs().argmin(-1).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return quant.mxfp4_from_blocks(packed, (e + 127).to(torch.uint8))


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


@pytest.mark.parametrize(
    "m,n,k,group",
    # per channel: K = 200 and 1028 (not multiples of 128), 204 (not even of 8: int4.c's own
    # linear); a partial last group (136 / 64), a narrow column block (N = 33, 7)
    [
        (1, 40, 256, 32),
        (5, 33, 136, 64),
        (17, 48, 384, 128),
        (3, 7, 200, "channel"),
        (2, 24, 204, "channel"),
        (9, 16, 1028, "channel"),
    ],
)
@pytest.mark.parametrize("scheme", ["asymmetric", "symmetric", "asymmetric-rotated"])
def test_int4_linear_with_zero_points_and_groups_gives_the_references_floats(
    int4_path, m, n, k, group, scheme
):
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g)
    group = k if group == "channel" else group
    if scheme == "symmetric":
        qw = quant.quantize_int4(w, group=group, rotated=False)
    else:
        qw = asymmetric_int4(w, group, rotated=scheme.endswith("rotated"))
        assert qw.zero is not None and bool((qw.zero != 8).any())
    packed = cpu_kernels.pack_qweight(qw)
    assert packed.data.numel() == -(-k // 8) * 4 * n and packed.group == qw.group
    x = rows(m, k, seed=k)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.linear(x, packed, bias), quant.linear(x, qw, bias))


@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (6, 33, 96), (20, 64, 1024)])
def test_mxfp4_linear_gives_the_references_floats(int4_path, m, n, k):
    g = torch.Generator().manual_seed(n)
    qw = mxfp4(torch.randn(n, k, generator=g))
    packed = cpu_kernels.pack_qweight(qw)
    assert packed.fmt == "mxfp4" and packed.data.numel() == k * n // 2
    x = rows(m, k, seed=m)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))
    assert torch.equal(cpu_kernels.linear(x, packed), quant.linear(x, qw))


def test_every_mxfp4_code_and_the_scales_extremes_are_exact(int4_path):
    """Each of the 16 codes (both zeros too) in every lane, e8m0 scales from 2^-127 to 2^100,
    activations at +-127: the register lookup's table and the zero 12 hold everywhere. Two
    columns all +6 and all -6 (the looked-up bytes' extremes, 24 and 0) against rows all +-127:
    AVX2's int16 sums over a span of octets stay in range."""
    n, k = 16, 512
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    codes = torch.stack([codes[i].roll(i) for i in range(n)])
    codes[0], codes[1] = 7, 15  # e2m1 +6 and -6
    blocks = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.randint(100, 140, (n, k // 32), generator=torch.Generator().manual_seed(0))
    scales = scales.to(torch.uint8)
    scales[0, :3] = torch.tensor([0, 1, 227], dtype=torch.uint8)
    qw = quant.mxfp4_from_blocks(blocks, scales)
    x = torch.full((3, k), 127.0).bfloat16()
    x[1] = -127.0
    x[2, ::3] = -127.0
    packed = cpu_kernels.pack_qweight(qw)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))


@pytest.mark.parametrize("group", [32, 2048])
def test_int4_zero_points_at_their_extremes_are_exact(int4_path, group):
    """Levels 0 and 15 against zero points from -128 to 127 over many groups of 32 or one of
    2048 (sums to 37M, past float32's exact integers: rounded once, as the reference's), every
    activation +-127: the int32 offsets z * sum(x) neither wrap nor round."""
    n, k = 32, 2048
    levels = torch.zeros(n, k, dtype=torch.uint8)
    levels[::2] = 15
    zeros = torch.tensor([-128, 127, 0, 16]).repeat(n // 4).unsqueeze(-1).expand(n, k // group)
    qw = quant.int4_from_levels(levels, torch.ones(n, k // group), zeros, group)
    x = torch.full((2, k), 127.0).bfloat16()
    x[1, ::2] = -127.0
    packed = cpu_kernels.pack_qweight(qw)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))


@pytest.mark.parametrize(
    "fmt,group",
    [("asymmetric", 32), ("asymmetric", 128), ("asymmetric", "channel"), ("mxfp4", 32)],
)
# (1, 72, 40, 4): one token (int4.c's one-row pass) with a narrow last block of w2 (D = 72) whose
# scales and zeros are read in place, and groups of 9 and 5 octets (not whole unrolled steps)
@pytest.mark.parametrize(
    "t,d,i,e", [(1, 64, 128, 8), (1, 72, 40, 4), (7, 128, 40, 4), (40, 256, 64, 8)]
)
def test_moe_on_published_4bit_experts_matches_the_torch_path(int4_path, fmt, group, t, d, i, e):
    """ms_moe on unrotated experts with zero points or mxfp4 codes: its activation rows are
    quantized unrotated to match, and each product is the reference's."""
    if fmt == "mxfp4" and i % 32:
        pytest.skip("mxfp4 blocks are 32 inputs: I = 40 has no mxfp4 form")
    g = torch.Generator().manual_seed(t + d)
    w13, w2 = torch.randn(e, 2 * i, d, generator=g) * 0.1, torch.randn(e, d, i, generator=g) * 0.1
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), 2, True)
    if fmt == "mxfp4":
        q13, q2 = mxfp4(w13), mxfp4(w2)
    else:
        q13 = asymmetric_int4(w13, d if group == "channel" else group)
        q2 = asymmetric_int4(w2, i if group == "channel" else group)
    assert cpu_kernels.int4_moe_fits(q13, d) and not q13.rotated
    out, counts = cpu_kernels.moe(
        x, cpu_kernels.pack_qweight(q13), cpu_kernels.pack_qweight(q2), ids, weights
    )
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=e).tolist()
    # the torch path rounds the SwiGLU's inputs and the weighted sum in bf16
    ref = grouped_dispatch(x, weights, ids, counts, q13, q2, quant.linear).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=float(ref.abs().max()) * 2**-6)


# each published format as a quantizer of a float weight [..., N, K]
PUBLISHED = {
    "int4-asymmetric-g32": lambda w: asymmetric_int4(w, 32),
    "int4-symmetric-channel": lambda w: quant.quantize_int4(w, group=w.shape[-1], rotated=False),
    "mxfp4": mxfp4,
}
# the qwen2_moe layers given 4-bit weights (the routers and the lm_head keep theirs)
FOUR_BIT_LAYERS = ("attn.wqkv", "attn.wo", "shared.w13", "shared.w2")


@pytest.mark.parametrize("fmt", list(PUBLISHED))
def test_the_one_call_decode_step_on_published_4bit_weights(int4_path, model_dirs, fmt):
    """A model whose attention, dense MLP and experts hold unrotated 4-bit weights of a
    published format (its bf16 weights requantized in place, the fused step installed again
    over them): one fused decode step equals the composed layers."""
    eng = engine(model_dirs("qwen2_moe"))
    model, quantize = eng.executor.model, PUBLISHED[fmt]
    swapped = 0
    for name, module in model.named_modules():
        if isinstance(module, CpuLinear) and name.endswith(FOUR_BIT_LAYERS):
            w = cpu_kernels.unpack_weight(module.weight, 2 * module.weight.shape[-3]).float()
            del module.weight  # a bf16 parameter, where quantized layers hold a QWeight
            module.weight = cpu_kernels.pack_qweight(quantize(w))
            swapped += 1
        elif isinstance(module, CpuExperts):
            for attr in ("w13", "w2"):
                packed = getattr(module, attr)
                w = cpu_kernels.unpack_weight(packed, 2 * packed.shape[-3]).float()
                delattr(module, attr)
                setattr(module, attr, cpu_kernels.pack_qweight(quantize(w)))
            swapped += 1
    assert swapped == 5 * len(model.layers)
    eng.executor.fused_step = cpu_backend.install(model)
    assert eng.executor.fused_step is not None  # the fused step takes every 4-bit weight
    layer = model.layers[0]
    for w in (layer.attn.wqkv.weight, layer.mlp.moe.experts.w13):
        assert w.packed and not w.rotated and w.fmt == fmt.split("-")[0]
        assert (w.zero is not None) == (fmt == "int4-asymmetric-g32")
    fused_step_equals_the_composed_layers(eng)
