"""The AVX512-BF16 prefill-attention kernel (csrc/prefill_attention.c): a prompt chunk's
queries over its paged context, read in place by slot (bf16, 8-bit and int4 caches), with
sliding windows and sinks, against the dense float64 reference,
on the native and the emulated AVX512-BF16 builds; and the builds without it leave prompt
chunks to ATen's flash kernel."""

from __future__ import annotations

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuPagedAttention
from inference.models import paged_cache
from inference.models.attention import AttentionMetadata, PagedAttention, PrefillChunk
from tests.inference.kernel_paths import Path, forced
from tests.inference.test_prefill_attention import paged_context, reference

BF16_PATHS = [Path("avx512bf16"), Path("avx512bf16", emulated=True)]


@pytest.fixture(params=BF16_PATHS, ids=str)
def bf16_path(request):
    with forced(request.param) as p:
        yield p


@pytest.mark.parametrize(
    "heads,kv_heads,dim,context_len,length",
    [
        (8, 2, 64, 0, 40),  # a fresh prompt, 4 query heads a kv head (the demo MoE's shape)
        (9, 3, 64, 300, 70),  # after a prefix, key blocks of 64 crossed (SmolLM2's shape)
        (4, 4, 32, 37, 5),  # no grouping, a few queries after a prefix shorter than a block
        (16, 1, 128, 130, 33),  # 16 query heads a kv head: three queries a work item
        (6, 2, 64, 0, 1),  # one query
        (5, 1, 96, 63, 66),  # 5 heads a kv head: padding rows in every work item
    ],
)
def test_a_chunk_matches_the_dense_reference(bf16_path, heads, kv_heads, dim, context_len, length):
    total = context_len + length
    k_cache, v_cache, slots, keys, values = paged_context(total, kv_heads, dim, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(length, heads, dim, generator=g).bfloat16()
    scale = dim**-0.5
    assert cpu_kernels.prefill_attention_fits(q, k_cache)
    out = cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, context_len, scale)
    expected = reference(q, keys, values, context_len, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (length, heads, dim)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "context_len,length,window,sinks",
    [
        (0, 100, 16, False),  # a fresh prompt longer than its window
        (300, 64, 16, True),  # a window shorter than the chunk: the prefix barely reached
        (300, 10, 200, True),  # a window longer than the chunk, shorter than the context
        (100, 20, 500, False),  # a window longer than the whole context
        (250, 150, 70, True),  # windows crossing key blocks in every work item
        (40, 30, 0, True),  # sinks alone
    ],
)
def test_windows_and_sinks_match_the_dense_reference(bf16_path, context_len, length, window, sinks):
    heads, kv_heads, dim, scale = 8, 2, 64, 0.125
    total = context_len + length
    k_cache, v_cache, slots, keys, values = paged_context(total, kv_heads, dim, torch.bfloat16)
    q = torch.randn(length, heads, dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    sink = torch.linspace(-1.0, 3.0, heads) if sinks else None
    out = cpu_kernels.prefill_attention(
        q, k_cache, v_cache, slots, context_len, scale, sink, window
    )
    expected = reference(q, keys, values, context_len, scale, window, sink)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("context_len,length,window", [(0, 40, 0), (150, 70, 0), (150, 70, 48)])
def test_quantized_caches_read_as_dequantize_reads_them(
    bf16_path, kv_cache_dtype, context_len, length, window
):
    """8-bit and int4 caches (rows stored rotated): the kernel dequantizes a block of keys at a
    time, rotated back and rounded to bf16, as paged_cache.dequantize gives them to the parts."""
    heads, kv_heads, dim, scale = 8, 2, 64, 0.125
    total = context_len + length
    _, _, slots, keys, values = paged_context(total, kv_heads, dim, torch.bfloat16)
    storage = paged_cache.storage_dtype(kv_cache_dtype, torch.bfloat16)
    width = paged_cache.row_width(dim, storage)
    k_cache = torch.zeros(total + 40, kv_heads, width, dtype=storage)
    v_cache = torch.zeros_like(k_cache)
    paged_cache.write_kv(k_cache, slots, keys)
    paged_cache.write_kv(v_cache, slots, values)
    read_k = paged_cache.gather_slots(k_cache, slots, torch.bfloat16)
    read_v = paged_cache.gather_slots(v_cache, slots, torch.bfloat16)
    q = torch.randn(length, heads, dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert cpu_kernels.prefill_attention_fits(q, k_cache)
    out = cpu_kernels.prefill_attention(
        q, k_cache, v_cache, slots, context_len, scale, None, window
    )
    expected = reference(q, read_k, read_v, context_len, scale, window)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_queries_at_any_row_stride(bf16_path):
    """q as the rope kernel leaves it: a view of qkv rows (stride H + 2G heads)."""
    heads, kv_heads, dim, context_len, length = 4, 2, 64, 20, 30
    k_cache, v_cache, slots, keys, values = paged_context(
        context_len + length, kv_heads, dim, torch.bfloat16
    )
    qkv = torch.randn(length, heads + 2 * kv_heads, dim).bfloat16()
    q = qkv[:, :heads]
    out = cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, context_len, 0.125)
    expected = reference(q, keys, values, context_len, 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_large_scores_keep_the_softmax_finite(bf16_path):
    """Scores in the hundreds (a peaked softmax) and one key far above the rest."""
    heads, kv_heads, dim, context_len, length = 4, 1, 64, 90, 40
    k_cache, v_cache, slots, keys, values = paged_context(
        context_len + length, kv_heads, dim, torch.bfloat16, seed=5
    )
    q = (torch.randn(length, heads, dim) * 8).bfloat16()
    out = cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, context_len, 1.0)
    assert torch.isfinite(out.float()).all()
    expected = reference(q, keys, values, context_len, 1.0)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


def test_shapes_it_does_not_take_are_not_offered(bf16_path):
    q = torch.zeros(3, 4, 48, dtype=torch.bfloat16)
    assert not cpu_kernels.prefill_attention_fits(q, torch.zeros(8, 2, 48, dtype=torch.bfloat16))
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    assert not cpu_kernels.prefill_attention_fits(q, torch.zeros(8, 2, 64, dtype=torch.float32))
    assert not cpu_kernels.prefill_attention_fits(
        q.float(), torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    )


@pytest.mark.parametrize("path", [Path("avx512"), Path("avx2")], ids=str)
def test_other_builds_leave_prompt_chunks_to_aten(path, monkeypatch):
    """Without AVX512-BF16 the module's prefill is the parts' (ATen's flash kernel): the C
    kernel is never called, and the result is the reference's."""
    with forced(path):
        heads, kv_heads, dim, context_len, length = 4, 2, 64, 50, 20
        k_cache, v_cache, slots, keys, values = paged_context(
            context_len + length, kv_heads, dim, torch.bfloat16
        )
        q = torch.randn(length, heads, dim).bfloat16()
        assert not cpu_kernels.prefill_attention_fits(q, k_cache)

        def refuse(*args):
            raise AssertionError("ms_prefill_attention called without AVX512-BF16")

        monkeypatch.setattr(cpu_kernels, "prefill_attention", refuse)
        module = CpuPagedAttention(PagedAttention(heads, kv_heads, dim**-0.5).bfloat16())
        chunk = PrefillChunk(0, length, context_len, slots)
        meta = AttentionMetadata(slots[context_len:], 0, None, None, [chunk])
        out = module.prefill(
            q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk, meta.slot_mapping
        )
        expected = reference(q, keys, values, context_len, dim**-0.5)
        torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)
