"""The int4 KV cache's key shift: each attention layer's keys less a fixed mean per kv head.

A query's softmax does not change when all its scores move by the same amount, and
q . (k - m) = q . k - q . m for any m fixed per layer and kv head: the cache may hold the
keys less m and every reader use them as they are (SageAttention's "smooth K"). Keys share
a large common part; without it int4's groups of 32 spend their levels on it. On SmolLM2
(fake quantization, bench/NOTES.md 2026-12-07) the int4 cache's perplexity change went from
+5.6% to +3.2-3.9% with m the mean of 512 tokens of any English text.

m is measured at load, before any request: one prefill of a text every Python install has
(its LICENSE.txt, else module docstrings), the keys after RoPE (and q/k norms) averaged over
its positions but the first few (attention sinks, keys unlike the rest). The rows are
written shifted (PagedAttention.rope_and_write, the CPU kernels' rope_and_cache and the
fused decode step), so a prompt's fresh keys and its cached prefix agree. Layers whose
softmax has a learned sink logit (gpt-oss) are not shifted: the sink's score would not move
with the others. Nor is MLA's latent, which is no key. MOESERVE_KV_KEY_SHIFT=0 turns it off
(to compare).
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog
import torch
from torch import nn

from inference.models.attention import AttentionMetadata, PagedAttention, PrefillChunk
from inference.models.decoder import Attention

log = structlog.get_logger("inference.engine")

CALIBRATION_TOKENS = 512
SKIPPED_POSITIONS = 4  # the attention sinks' keys, far from the others


def enabled() -> bool:
    value = os.environ.get("MOESERVE_KV_KEY_SHIFT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MOESERVE_KV_KEY_SHIFT={value}: expected 1 or 0")
    return value == "1"


def calibration_text() -> str:
    """Python's LICENSE.txt (every CPython install has it beside the standard library), else
    a few standard modules' docstrings (absent only under python -OO)."""
    import argparse
    import collections
    import json
    import logging
    import subprocess

    license_txt = Path(os.__file__).parent / "LICENSE.txt"
    if license_txt.is_file():
        return license_txt.read_text(encoding="utf-8", errors="replace")
    modules = (argparse, collections, json, logging, subprocess, os)
    return "\n\n".join(m.__doc__ for m in modules if m.__doc__)


def calibration_ids(tokenizer) -> list[int]:
    """The calibration text's first CALIBRATION_TOKENS tokens in the model's tokenizer."""
    ids = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]
    return list(ids[:CALIBRATION_TOKENS])


def shifted_layers(model: nn.Module) -> list[Attention]:
    """The decoder layers' attention modules whose keys may be shifted: plain attention (not
    MLA) without sinks."""
    layers = (getattr(layer, "attn", None) for layer in getattr(model, "layers", ()))
    return [a for a in layers if isinstance(a, Attention) and a.attn.sinks is None]


def prepare(model: nn.Module, device: torch.device) -> None:
    """Gives each shiftable layer a zero shift [G, d] float32 (the fused decode step takes
    its address when installed; calibrate() fills it in place)."""
    for attn in shifted_layers(model):
        attn.attn.key_shift = torch.zeros(
            attn.num_kv_heads, attn.head_dim, dtype=torch.float32, device=device
        )


@torch.no_grad()
def calibrate(model: nn.Module, kv_caches: list, token_ids: list[int], max_tokens: int) -> int:
    """One prefill of token_ids (at most max_tokens: the cache's slots and the model's
    positions) through the model, writing cache slots 0.. (no request holds them yet); each
    shifted layer's key shift becomes its keys' mean over the positions after the first
    SKIPPED_POSITIONS. Returns the tokens used (0: too few, the shifts stay zero)."""
    n = min(len(token_ids), max_tokens)
    layers = [attn.attn for attn in shifted_layers(model)]
    if not layers or n <= 2 * SKIPPED_POSITIONS:
        return 0
    means: dict[int, torch.Tensor] = {}

    def recording(paged: PagedAttention):
        write = paged.rope_and_write

        def rope_and_write(qkv, cos, sin, meta, k_cache, v_cache):
            q, k, v = write(qkv, cos, sin, meta, k_cache, v_cache)
            means[id(paged)] = k[SKIPPED_POSITIONS:].float().mean(dim=0)
            return q, k, v

        return rope_and_write

    for paged in layers:  # an instance attribute over the method, for this pass only
        paged.rope_and_write = recording(paged)
    device = layers[0].key_shift.device
    try:
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            num_decode=0,
            decode_slots=None,
            decode_mask=None,
            prefills=[PrefillChunk(start=0, length=n, context_len=0, slots=None)],
        )
        positions = torch.arange(n, device=device)
        model(torch.tensor(token_ids[:n], device=device), positions, meta, kv_caches)
    finally:
        for paged in layers:
            del paged.rope_and_write
    for paged in layers:
        paged.key_shift.copy_(means[id(paged)])
    return n
