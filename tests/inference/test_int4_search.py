"""int4 levels, scales and zero points at load (quantization/int4_search.py, issue 40): each
method's levels are the nearest of its grid, a weight already on a 4-bit grid comes back
exactly, the search never fits worse than min/max, and the QWeight it builds reads back as
the levels say."""

from __future__ import annotations

import pytest
import torch

from inference.executor.quantize import Int4Choices, kept_wide, uses_more_bits
from inference.quantization.hadamard import rotate_by_products
from inference.quantization.int4_search import (
    METHODS,
    quantize_int4_levels,
    quantize_int4_searched,
)


def weight(n=48, k=320, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 7] *= 6  # an outlier input, as trained models have
    return w


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("integer_zeros", [False, True])
def test_levels_are_the_nearest_of_the_grid_and_the_error_is_bounded(method, group, integer_zeros):
    w = weight()
    q = quantize_int4_levels(w, group, method, integer_zeros)
    groups = -(-w.shape[1] // group)
    assert q.levels.dtype == torch.uint8 and q.levels.shape == w.shape
    assert q.scales.shape == (48, groups) and int(q.levels.max()) <= 15
    zeros = torch.full_like(q.scales, 8.0) if q.zeros is None else q.zeros
    if integer_zeros and q.zeros is not None:
        assert torch.equal(q.zeros, q.zeros.round())
    scale = q.scales.repeat_interleave(group, -1)[:, : w.shape[1]]
    zero = zeros.repeat_interleave(group, -1)[:, : w.shape[1]]
    nearest = (w / scale + zero).round().clamp(0, 15)
    # rounding to the nearest level: off by one only at exact halves (float ties)
    assert (q.levels.float() - nearest).abs().max() <= 1
    assert (q.levels.float() != nearest).float().mean() < 1e-3
    error = (q.dequantize() - w).abs()
    inside = (w / scale + zero >= -0.5) & (w / scale + zero <= 15.5)
    # within the grid's span, half a step; outside it, the distance to the grid's end
    # (Q4_0's symmetric scales are negative where the group's largest magnitude is positive)
    assert (error[inside] <= 0.5 * scale[inside].abs() * (1 + 1e-5) + 1e-7).all()
    relative = (error.pow(2).sum() / w.pow(2).sum()).item()
    # measured: 0.0105 / 0.0238 symmetric, 0.0073 / 0.0147 min/max, 0.0070 / 0.0143 the search
    # (integer zeros; float ones 0.0056 / 0.0132)
    bound = {"symmetric": (0.016, 0.036), "minmax": (0.011, 0.022), "search": (0.0085, 0.018)}
    assert relative < bound[method][group == 128], (method, group, relative)


@pytest.mark.parametrize("group", [32, 64])
def test_a_weight_on_a_4bit_grid_comes_back_exactly(group):
    g = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (16, 256), generator=g)
    levels[:, ::group] = 0  # every group reaches both ends of the grid
    levels[:, 1::group] = 15
    scales = torch.rand(16, 256 // group, generator=g) * 0.01 + 0.001
    zeros = torch.randint(3, 12, (16, 256 // group), generator=g).float()
    w = (levels - zeros.repeat_interleave(group, -1)) * scales.repeat_interleave(group, -1)
    for method in ("minmax", "search"):
        q = quantize_int4_levels(w, group, method, integer_zeros=True)
        assert torch.equal(q.levels, levels.to(torch.uint8)), method
        torch.testing.assert_close(q.dequantize(), w, rtol=1e-5, atol=1e-7)


def test_the_search_fits_no_worse_than_min_max():
    w = weight(seed=5)
    importance = w.pow(2).unflatten(-1, (10, 32)).mean(-1, keepdim=True).sqrt()
    importance = (importance + w.abs().unflatten(-1, (10, 32))).flatten(-2)

    def weighted_error(method):
        q = quantize_int4_levels(w, 32, method)
        return (importance * (q.dequantize() - w).pow(2)).unflatten(-1, (10, 32)).sum(-1)

    searched, minmax = weighted_error("search"), weighted_error("minmax")
    assert (searched <= minmax * (1 + 1e-5)).all()
    assert searched.sum() < 0.9 * minmax.sum()  # and much better overall


def test_the_searched_qweight_reads_back_as_its_levels():
    w = weight(n=24, k=576)  # SmolLM2's width: 4.5 groups of 128
    for rotated in (True, False):
        qw = quantize_int4_searched(w, 128, "search", rotated)
        assert qw.fmt == "int4" and qw.rotated == rotated and qw.zero is not None
        rows = rotate_by_products(w) if rotated else w
        levels = quantize_int4_levels(rows, 128, "search", integer_zeros=True)
        expect = rotate_by_products(levels.dequantize()) if rotated else levels.dequantize()
        torch.testing.assert_close(qw.dequantize(), expect, rtol=1e-5, atol=1e-6)
    stacked = quantize_int4_searched(torch.stack([w, -w]), 128)  # experts [E, N, K]
    assert stacked.scale.shape == (2, 5, 24)
    symmetric = quantize_int4_searched(w, 128, "symmetric")
    assert symmetric.zero is None


def test_an_unknown_method_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="int4 method 'q3'"):
        quantize_int4_levels(weight(), 128, "q3")
    monkeypatch.setenv("MOESERVE_INT4_METHOD", "q3")
    with pytest.raises(ValueError, match="MOESERVE_INT4_METHOD"):
        Int4Choices.from_environ()


def test_the_sensitive_projections_are_llama_cpps():
    # llama.cpp's use_more_bits for 30 layers (SmolLM2): 0-2, 26-29 and every third between
    assert [i for i in range(30) if uses_more_bits(i, 30)] == [
        0,
        1,
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        26,
        27,
        28,
        29,
    ]
    # MOESERVE_INT4_WIDE=1: q/k/v and the dense down projection of those layers only
    assert kept_wide("model.layers.0.attn.wqkv", 30, "layers")
    assert kept_wide("layers.5.mlp.w2", 30, "layers")
    assert not kept_wide("layers.5.attn.wo", 30, "layers")
    assert not kept_wide("layers.4.mlp.w2", 30, "layers")
    # the default (MOESERVE_INT4_WIDE=all): every layer's; 0: none; experts never
    assert kept_wide("layers.4.mlp.w2", 30) and kept_wide("layers.4.attn.wqkv", 30)
    assert not kept_wide("layers.4.attn.wo", 30)
    assert not kept_wide("layers.0.mlp.experts", 30)
    assert not kept_wide("layers.0.attn.wqkv", 30, "none")


def test_the_wide_switch_reads_its_three_values(monkeypatch):
    monkeypatch.delenv("MOESERVE_INT4_WIDE", raising=False)
    assert Int4Choices.from_environ().wide == "all"  # the default
    for value, wide in (("0", "none"), ("1", "layers"), ("all", "all")):
        monkeypatch.setenv("MOESERVE_INT4_WIDE", value)
        assert Int4Choices.from_environ().wide == wide
    monkeypatch.setenv("MOESERVE_INT4_WIDE", "some")
    with pytest.raises(ValueError, match="MOESERVE_INT4_WIDE=some"):
        Int4Choices.from_environ()


def test_chunks_of_rows_give_the_same_levels(monkeypatch):
    """Large stacks are quantized a chunk of rows at a time (memory): the same result."""
    from inference.quantization import int4_search

    w = torch.stack([weight(n=20, k=256, seed=s) for s in range(3)])  # experts [3, 20, 256]
    whole = quantize_int4_levels(w, 64, "search", integer_zeros=True)
    monkeypatch.setattr(int4_search, "CHUNK", 7 * 256)  # 7 rows a chunk: 60 rows, uneven
    parts = quantize_int4_levels(w, 64, "search", integer_zeros=True)
    assert parts.levels.shape == (3, 20, 256) and parts.scales.shape == (3, 20, 4)
    assert torch.equal(parts.levels, whole.levels) and torch.equal(parts.zeros, whole.zeros)
    assert torch.equal(parts.scales, whole.scales)
