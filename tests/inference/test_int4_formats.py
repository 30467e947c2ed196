"""4-bit weights as published formats give them (issue 40): int4_from_levels (GPTQ, AWQ,
compressed-tensors once unpacked: levels, scales, integer zero points, groups of 32/64/128
or per channel) and mxfp4_from_blocks (gpt-oss's e2m1 blocks and e8m0 scales). Each
dequantizes to the format's own definition; transformers' own MXFP4 dequantization is the
reference for gpt-oss's; the W4A8 torch reference sums the same integers exactly."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from inference.quantization import qweight as quant


def published_int4(lead, n, k, group, asymmetric, seed=0):
    """levels [..., N, K] in [0, 15], scales and zero points [..., N, G] as a checkpoint
    holds them."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    levels = torch.randint(0, 16, (*lead, n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(*lead, n, groups, generator=g).half()  # GPTQ/AWQ keep fp16 scales
    zeros = torch.randint(0, 16, (*lead, n, groups), generator=g) if asymmetric else None
    return levels, scales, zeros


def by_definition(levels, scales, zeros, group):
    """w = (level - zero) * scale, each input taking its group's scale and zero."""
    k = levels.shape[-1]
    zero = torch.full_like(scales, 8.0) if zeros is None else zeros
    expand = lambda t: t.float().repeat_interleave(group, dim=-1)[..., :k]
    return (levels.float() - expand(zero)) * expand(scales)


@pytest.mark.parametrize("group", [32, 64, 128, "channel"])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_int4_from_levels_dequantizes_by_the_formats_definition(group, asymmetric, lead):
    k = 200 if group == "channel" else 256  # per channel: any K, not a multiple of 8
    group = k if group == "channel" else group
    levels, scales, zeros = published_int4(lead, 24, k, group, asymmetric)
    w = quant.int4_from_levels(levels, scales, zeros, group)
    assert w.fmt == "int4" and not w.rotated and w.group == group and w.in_features == k
    assert w.scale.shape == (*lead, -(-k // group), 24) and w.scale.dtype == torch.float32
    assert (w.zero is None) == (not asymmetric)
    expect = by_definition(levels, scales, zeros, group)
    assert torch.equal(w.dequantize(), expect)
    if lead:  # one expert of a stack is that expert's weight
        assert torch.equal(w[1].dequantize(), expect[1])


def test_symmetric_zero_points_are_the_same_weight_as_none():
    levels, scales, _ = published_int4((), 16, 128, 64, False)
    eights = torch.full((16, 2), 8)
    assert torch.equal(
        quant.int4_from_levels(levels, scales, eights, 64).dequantize(),
        quant.int4_from_levels(levels, scales, None, 64).dequantize(),
    )


def test_quantize_int4_is_built_on_the_levels_constructor():
    w = torch.randn(20, 300, generator=torch.Generator().manual_seed(2))
    qw = quant.quantize_int4(w, rotated=False)
    levels = (qw.data.to(torch.int16) + 8).to(torch.uint8)
    again = quant.int4_from_levels(levels, qw.scale.t(), None, qw.group)
    assert torch.equal(again.data, qw.data) and torch.equal(again.dequantize(), qw.dequantize())


def test_the_torch_reference_sums_levels_minus_zeros_exactly():
    """W4A8 with zero points: each group's exact integer sum of (level - zero) * q times its
    scale, in order, then the row's scale (the kernels' floats, csrc/int4.c)."""
    levels, scales, zeros = published_int4((), 6, 96, 32, True, seed=3)
    w = quant.int4_from_levels(levels, scales, zeros, 32)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4))
    q, sx = quant.quantize_activations(x, w)
    expect = torch.zeros(2, 6)
    for i in range(2):
        for n in range(6):
            acc = torch.tensor(0.0)
            for gi in range(3):
                part = slice(32 * gi, 32 * gi + 32)
                ints = levels[n, part].long() - int(zeros[n, gi])
                s = int((q[i, part].long() * ints).sum())
                acc = acc + torch.tensor(float(s)) * w.scale[gi, n]
            expect[i, n] = acc * sx[i]
    assert torch.equal(quant.linear(x, w), expect)
    # and the products are those of the dequantized weight, up to the activations' rounding
    close = x @ w.dequantize().t()
    assert (expect - close).abs().max() < 0.05 * close.abs().max()


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"levels": torch.full((4, 64), 16, dtype=torch.uint8)}, r"\[0, 15\]"),
        ({"levels": torch.zeros(4, 64)}, "integers"),
        ({"zeros": torch.full((4, 2), 7.5)}, "whole numbers"),
        ({"zeros": torch.full((4, 2), 200)}, "whole numbers"),
        ({"zeros": torch.zeros(4, 3)}, "zeros have shape"),
        ({"scales": torch.ones(4, 3)}, "scales have shape"),
        ({"group": 12}, "multiple of 8"),
    ],
)
def test_bad_int4_tensors_are_clear_errors(bad, message):
    args = {
        "levels": torch.zeros(4, 64, dtype=torch.uint8),
        "scales": torch.ones(4, 2),
        "zeros": None,
        "group": 32,
    }
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        quant.int4_from_levels(**args)


def published_mxfp4(lead, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (*lead, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_from_blocks_dequantizes_as_transformers_does():
    blocks, scales = published_mxfp4((4,), 40, 192)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # e8m0's extremes
    w = quant.mxfp4_from_blocks(blocks, scales)
    assert w.fmt == "mxfp4" and not w.rotated and w.group == 32 and w.in_features == 192
    assert w.data.dtype == torch.int8 and w.scale.shape == (4, 6, 40)
    # transformers returns gpt-oss's experts transposed ([E, K, N]); the values bit for bit
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(w.dequantize(), reference.transpose(1, 2))
    # the doubled values are the integers the products sum
    assert set(w.data.unique().tolist()) <= set(quant.E2M1_DOUBLED)
    # the flat [..., N, K/2] form of the same blocks is the same weight
    flat = quant.mxfp4_from_blocks(blocks.flatten(-2), scales)
    assert torch.equal(flat.data, w.data) and torch.equal(flat.scale, w.scale)


def test_mxfp4_nibble_order_is_low_then_high():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # input 0: code 2 (1.0), input 1: code 7 (6.0)
    w = quant.mxfp4_from_blocks(blocks, torch.full((1, 1), 127, dtype=torch.uint8))
    assert w.dequantize()[0, :3].tolist() == [1.0, 6.0, 0.0]


@pytest.mark.parametrize(
    "blocks,scales,message",
    [
        (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "shape"),
        (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "uint8"),
        (torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 255, dtype=torch.uint8), "NaN"),
    ],
)
def test_bad_mxfp4_tensors_are_clear_errors(blocks, scales, message):
    with pytest.raises(ValueError, match=message):
        quant.mxfp4_from_blocks(blocks, scales)


def test_group_sums_beyond_float32s_integers_stay_exact():
    """A whole column of 2048 inputs at level 15 against zero point -128 (143 a weight): sums
    up to 37M, past float32's exact integers (2^24), are still the exact integer sums,
    rounded once."""
    k = 2048
    levels = torch.full((3, k), 15, dtype=torch.uint8)
    levels[1, ::3] = 0
    w = quant.int4_from_levels(levels, torch.ones(3, 1) / 7, torch.full((3, 1), -128), k)
    x = 1 + 0.2 * torch.rand(2, k, generator=torch.Generator().manual_seed(5))
    q, sx = quant.quantize_activations(x, w)
    sums = q.long() @ w.integers().long().t()  # int64: exact
    assert int(sums.abs().max()) > 2**24
    expect = sums.float() * w.scale[0] * sx.unsqueeze(-1)
    assert torch.equal(quant.linear(x, w), expect)
