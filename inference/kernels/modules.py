"""The model's modules on our CPU kernels (cpu.py): what executor/cpu_backend.py installs in place
of the plain ones in a bf16 engine on the CPU, their weights prepacked once at load into the
kernels' layout (bf16 pairs, or 8-bit quads for quantization/qweight.py's QWeights).

Each keeps its plain module's interface, and falls back to it for an input the kernels do
not take (not bf16, not on the CPU, kernels switched off)."""

from __future__ import annotations

import torch
from torch import nn

from inference.kernels import cpu
from inference.models.attention import AttentionMetadata, PagedAttention
from inference.models.layers import RMSNorm
from inference.models.mla import AbsorbedAttention, latent_attention
from inference.quantization.qweight import QWeight


def packed(w: torch.Tensor | QWeight) -> torch.Tensor | QWeight:
    """A row-major weight in the kernels' layout (bf16 pairs or 8-bit quads, in huge pages:
    cpu.pack_weight); packed weights have one dimension more than their matrix, so they are
    never mistaken for row-major ones."""
    if isinstance(w, QWeight):
        return cpu.pack_qweight(w)
    return nn.Parameter(cpu.pack_weight(w.data), requires_grad=False)


class CpuLinear(nn.Module):
    """x @ W^T (+ bias) for any number of rows, on a packed bf16 or 8-bit weight."""

    def __init__(self, weight: torch.Tensor | QWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = packed(weight)
        self.bias = None if bias is None else nn.Parameter(bias.data, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu.linear(x, self.weight, self.bias)


class CpuRMSNorm(RMSNorm):
    """RMSNorm, with the residual add fused into the same pass (the sum written into
    `residual` in place)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not (cpu.applies(x) and self.weight.dtype == torch.bfloat16):
            return super().forward(x, residual)
        if residual is None:
            return cpu.rms_norm(x, self.weight, self.eps)
        return cpu.rms_norm(x, self.weight, self.eps, residual), residual


class CpuExperts(nn.Module):
    """Stacked experts in one call per layer for any number of tokens (cpu.moe): pairs sorted by
    expert, each expert with tokens read once, the others not at all. `plain`: the experts
    replaced (Experts or 8-bit QuantExperts), whose biases and clamped SwiGLU (gpt-oss) the
    kernel applies in its epilogues."""

    def __init__(self, plain: nn.Module) -> None:
        super().__init__()
        w13, w2 = plain.w13, plain.w2
        scale = w13.scale if isinstance(w13, QWeight) else None
        self.num_experts = w13.shape[0] if scale is None else scale.shape[0]
        self.intermediate_size = (w13.shape[1] if scale is None else scale.shape[-1]) // 2
        self.w13, self.w2 = packed(w13), packed(w2)
        self.glu = None
        if plain.b13 is not None or plain.glu is not None:
            self.b13 = None if plain.b13 is None else plain.b13.data.float().contiguous()
            self.b2 = None if plain.b2 is None else plain.b2.data.float().contiguous()
            self.glu = cpu.MoeGlu(
                _address(self.b13),
                _address(self.b2),
                plain.glu.alpha if plain.glu else 0.0,
                plain.glu.limit if plain.glu else 0.0,
            )

    def forward(self, x, weights, ids) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu.moe(x, self.w13, self.w2, ids, weights, self.glu)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuPagedAttention(PagedAttention):
    """Rope and the cache write in one pass over qkv (in place); decode rows read the paged
    cache in place through block tables (the model runner builds them for this backend),
    honouring the plain module's sliding window and sinks; prompt chunks read it in place by
    slot where the CPU has AVX512-BF16 (else attention_parts.py)."""

    def __init__(self, plain: PagedAttention) -> None:
        super().__init__(plain.num_heads, plain.num_kv_heads, plain.scale, plain.window)
        self.sinks = plain.sinks
        self.sinks32 = None if plain.sinks is None else plain.sinks.data.float().contiguous()
        self.key_shift, self.key_hinv = plain.key_shift, plain.key_hinv

    def rope_and_write(self, qkv, cos, sin, meta, k_cache, v_cache):
        if not cpu.applies(qkv):
            return super().rope_and_write(qkv, cos, sin, meta, k_cache, v_cache)
        h, g = self.num_heads, self.num_kv_heads
        slots = meta.slot_mapping
        cpu.rope_and_cache(
            qkv, cos, sin, h, g, slots, k_cache, v_cache, self.key_shift, self.key_hinv
        )
        return qkv[:, :h], qkv[:, h : h + g], qkv[:, h + g :]

    def prefill(self, q, k, v, k_cache, v_cache, chunk, new_slots) -> torch.Tensor:
        if not cpu.prefill_attention_fits(q, k_cache):
            return super().prefill(q, k, v, k_cache, v_cache, chunk, new_slots)
        slots = new_slots if chunk.slots is None else chunk.slots
        return cpu.prefill_attention(
            q, k_cache, v_cache, slots, chunk.context_len, self.scale, self.sinks32, self.window
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.block_tables is None:
            return super().decode(q, k_cache, v_cache, meta)
        return cpu.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.block_size,
            self.scale,
            sinks=self.sinks32,
            window=self.window,
        )


class CpuAbsorbedAttention(AbsorbedAttention):
    """MLA's absorbed decode: the two absorbed projections as per-head products on prepacked
    W_UK^T and W_UV (derived from the row-major kv_b_proj weight given at construction),
    and the attention over the latent cache read in place."""

    def __init__(self, plain: AbsorbedAttention, wkv_b: torch.Tensor) -> None:
        super().__init__(
            plain.num_heads, plain.nope_dim, plain.v_dim, plain.kv_lora_rank, plain.scale
        )
        w = wkv_b.data.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk_t = cpu.pack_weight(w[:, : self.nope_dim].transpose(1, 2))  # [H] of [r, n]
        self.w_uv = cpu.pack_weight(w[:, self.nope_dim :])  # [H] of [v, r]

    def forward(self, q_nope, q_pe, cache, meta: AttentionMetadata, wkv_b=None):
        r = self.kv_lora_rank
        q_abs = torch.cat((cpu.linear_heads(q_nope, self.w_uk_t), q_pe), dim=-1)
        if meta.block_tables is None:
            o = latent_attention(q_abs, cache, meta, self.scale, r)
        else:
            o = cpu.decode_attention(
                q_abs,
                cache,
                cache,
                meta.block_tables,
                meta.context_lens,
                meta.block_size,
                self.scale,
                r,
            )
        return cpu.linear_heads(o, self.w_uv)


class CpuQuantEmbedding(nn.Module):
    """An int8 embedding table's rows dequantized and rotated back in C (cpu.embed_int8): a
    decode step's 32 rows in ~10 us, where torch's products take 0.3 ms."""

    def __init__(self, plain: nn.Module) -> None:  # executor/quantize.py's QuantEmbedding
        super().__init__()
        self.plain = plain

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plain.dtype == torch.bfloat16 and cpu.ISA is not None and ids.is_cpu:
            return cpu.embed_int8(self.plain.weight, ids)
        return self.plain(ids)
