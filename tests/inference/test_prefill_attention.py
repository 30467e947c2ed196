"""Prefill attention in parts (models/attention_parts.py): a chunk after a cached prefix,
with sliding windows and sinks, against a dense float64 reference, in float32 and bf16, on
the plain modules and on each CPU kernel path (the paged cache written by that path's rope
kernel); the device-independent loop against the CPU flash kernel; and no tensor as large
as the chunk times its context built on the way."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inference.kernels.modules import CpuPagedAttention
from inference.models.attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    prefill_attention,
)
from inference.models.attention_parts import attend_lse, blocked_lse
from tests.inference.kernel_paths import PATHS, forced

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(q, keys, values, context_len, scale, window=0, sinks=None):
    """q [c, H, d] at positions context_len + i over keys, values [context_len + c, G, d]
    (position = index), dense in float64 -> [c, H, dv]."""
    c, h, _ = q.shape
    total, g = keys.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(h // g, 1).transpose(0, 1)  # [H, total, d]
    v = values.double().repeat_interleave(h // g, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, c, total]
    i = torch.arange(context_len, context_len + c)[:, None]
    j = torch.arange(total)[None, :]
    hidden = j > i
    if window:
        hidden |= j <= i - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(h, 1, 1).expand(h, c, 1)
        weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ v).transpose(0, 1)


def paged_context(total, kv_heads, dim, dtype, seed=0):
    """A context of `total` positions scattered over a paged cache: (k_cache, v_cache,
    slots, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    values = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm(total + 40, generator=g)[:total]
    k_cache = torch.zeros(total + 40, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots], v_cache[slots] = keys, values
    return k_cache, v_cache, slots, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "context_len,length,window,sinks",
    [
        (0, 48, 0, False),  # a fresh prompt
        (0, 48, 16, True),  # a fresh prompt longer than its window, with sinks
        (300, 64, 0, False),  # a chunk after a long prefix
        (300, 64, 0, True),
        (37, 5, 0, False),  # a few queries after a prefix shorter than a block
        (300, 64, 16, False),  # a window shorter than the chunk: the prefix barely reached
        (300, 10, 16, True),  # a chunk shorter than its window
        (300, 64, 200, True),  # a window longer than the chunk, shorter than the context
        (100, 20, 500, False),  # a window longer than the whole context
        (300, 1, 0, True),  # one query
    ],
)
def test_a_chunk_after_its_prefix_matches_the_dense_reference(
    dtype, context_len, length, window, sinks
):
    heads, kv_heads, dim, scale = 6, 2, 32, 0.17
    total = context_len + length
    k_cache, v_cache, slots, keys, values = paged_context(total, kv_heads, dim, dtype)
    q = torch.randn(length, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    sink = torch.linspace(-1.0, 3.0, heads).to(dtype) if sinks else None
    chunk = PrefillChunk(0, length, context_len, slots if context_len else None)
    out = prefill_attention(
        q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk, scale, window, sink
    )
    expected = reference(q, keys, values, context_len, scale, window, sink)
    assert out.dtype == dtype and out.shape == (length, heads, dim)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,queries,keys,dk,dv,causal,masked",
    [
        (8, 2, 40, 40, 32, 32, True, False),  # causal over itself, grouped heads
        (4, 4, 17, 90, 24, 24, False, False),  # a prefix, several key blocks
        (4, 1, 9, 30, 24, 24, False, True),  # an additive mask
        (4, 4, 12, 50, 48, 32, False, False),  # MLA: keys wider than values
    ],
)
def test_the_device_independent_loop_matches_the_cpu_flash_kernel(
    dtype, heads, kv_heads, queries, keys, dk, dv, causal, masked
):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, heads, queries, dk, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, keys, dk, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, keys, dv, generator=g).to(dtype)
    bias = None
    if masked:  # each query sees a band of keys, never none
        i, j = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
        band = (j >= i) & (j < i + 12)
        bias = torch.zeros(queries, keys, dtype=dtype).masked_fill(~band, float("-inf"))
    out, lse = attend_lse(q, k, v, 0.2, causal, bias)
    loop_out, loop_lse = blocked_lse(q, k, v, 0.2, causal, bias, block=7)
    tol = TOLERANCE[dtype]
    assert out.shape == loop_out.shape == (1, heads, queries, dv)
    torch.testing.assert_close(loop_out.float(), out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(loop_lse, lse, rtol=1e-4, atol=1e-4)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any ATen op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, tuple | list) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("window,sinks", [(0, False), (0, True), (64, True)])
def test_no_tensor_as_large_as_the_chunk_times_its_context(window, sinks):
    """The masks and scores of a 256-token chunk after 4,096 cached tokens stay far smaller
    than 256 x 4,352 (the mask SDPA would take); the largest tensors are the gathered
    context's keys and values (4,352 x 2 x 16)."""
    heads, kv_heads, dim, context_len, length = 4, 2, 16, 4096, 256
    total = context_len + length
    k_cache, v_cache, slots, keys, values = paged_context(total, kv_heads, dim, torch.float32)
    q = torch.randn(length, heads, dim)
    sink = torch.zeros(heads) if sinks else None
    chunk = PrefillChunk(0, length, context_len, slots)
    with LargestTensor() as seen:
        out = prefill_attention(
            q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk, 0.25, window, sink
        )
    assert out.shape == (length, heads, dim)
    assert seen.largest <= total * kv_heads * dim < length * total // 2


def prefill_meta(context_len, length, slots):
    """A step of one prompt chunk after `context_len` cached positions."""
    new = slots[context_len:]
    chunk = PrefillChunk(0, length, context_len, slots if context_len else None)
    return AttentionMetadata(new, 0, None, None, [chunk])


@pytest.fixture(params=[None, *PATHS], ids=lambda p: "aten" if p is None else str(p))
def attention_path(request):
    """None: the plain module (MOESERVE_BF16_KERNELS=0); else the kernels' module on that
    path (its rope kernel writing the cache)."""
    if request.param is None:
        yield None
        return
    with forced(request.param) as p:
        yield p


@pytest.mark.parametrize("window,sinks", [(0, False), (24, True)])
def test_paged_attention_prefills_after_a_prefix_on_each_path(attention_path, window, sinks):
    """PagedAttention (or the kernels' CpuPagedAttention) in bf16: a first chunk, then a
    second after it, together as the reference's one prompt."""
    heads, kv_heads, dim, first, second = 4, 2, 32, 70, 50
    total = first + second
    plain = PagedAttention(heads, kv_heads, dim**-0.5, window, sinks)
    if sinks:
        plain.sinks.data = torch.linspace(-2.0, 2.0, heads)
    plain = plain.to(torch.bfloat16)
    module = plain if attention_path is None else CpuPagedAttention(plain)
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(total, heads + 2 * kv_heads, dim, generator=g).bfloat16()
    angles = torch.arange(total).float()[:, None] * torch.logspace(0, -3, dim // 2)[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1).bfloat16()
    sin = torch.cat((angles.sin(), angles.sin()), -1).unsqueeze(1).bfloat16()
    k_cache = torch.zeros(total + 16, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(total + 16, generator=g)[:total]
    with torch.inference_mode():
        for start, end in ((0, first), (first, total)):
            meta = prefill_meta(start, end - start, slots[:end])
            step = qkv[start:end].clone()  # the kernels rotate in place
            out = module(step, cos[start:end], sin[start:end], meta, k_cache, v_cache)
        q, k, v = plain.rope_and_write(  # the rotated queries and keys, as the reference sees them
            qkv.clone(), cos, sin, prefill_meta(0, total, slots), k_cache.clone(), v_cache.clone()
        )
    sink = plain.sinks.data if sinks else None
    expected = reference(q[first:], k, v, first, plain.scale, window, sink)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)
