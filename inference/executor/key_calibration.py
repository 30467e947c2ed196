"""The int4 KV cache's keys, calibrated at load: a shift and a rounding per layer and kv head.

Nearly all of the int4 cache's perplexity cost is the keys' (bench/NOTES.md 2026-12-06), and
what a key's error costs is what the queries see of it, q . (k^ - k). Two things cut it, each
measured once, before any request, from one prefill of a text every Python install has (its
LICENSE.txt, else module docstrings):

- The shift. A query's softmax does not change when all its scores move alike, and
  q . (k - m) = q . k - q . m for any m fixed per layer and kv head: the cache holds the keys
  less m and every reader uses them as they are (SageAttention's "smooth K"). Keys share a
  large common part that int4's groups of 32 would otherwise spend their levels on. m: the
  keys' mean after RoPE (and q/k norms) over the text's positions but the first few
  (attention sinks, unlike the rest). Rows are written shifted (PagedAttention.rope_and_write,
  the rope kernel, the fused decode step), so a prompt's fresh keys and its cached prefix
  agree. Not where a learned sink logit joins the softmax (gpt-oss): it would not move with
  the other scores.
- The rounding. Each key row (rotated, at its groups' scales as before) is rounded value by
  value as GPTQ rounds a weight row, each value's rounding error carried into the values
  after it, so that the error lands where the queries look least: for E[(q . e)^2] = e^T H e
  with H the head's query second moment (the queries of the heads sharing the kv head, in
  the rotated space), damped by DAMPING of its mean diagonal. The writers take the upper
  Cholesky factor of H^-1 (csrc/kv_rows.c; paged_cache.quantize_int4's weights write the
  same bytes, but its loop over a row's values would cost each layer's write milliseconds:
  the rounding is the CPU kernels', the torch path's rows round plainly).

SmolLM2, fake quantization at 8,192 tokens (NOTES 2026-12-07 23:00): +3.9% with the shift,
+2.1% with both (values as before). MLA's latent is no key: left alone.
MOESERVE_KV_KEY_SHIFT=0 / MOESERVE_KV_KEY_ROUNDING=0 turn either off (to compare).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from inference.models.attention import AttentionMetadata, PagedAttention, PrefillChunk
from inference.models.decoder import Attention
from inference.quantization.hadamard import rotate

CALIBRATION_TOKENS = 512
SKIPPED_POSITIONS = 4  # the attention sinks' keys, far from the others
DAMPING = 0.01


def switch(name: str) -> bool:
    """MOESERVE_KV_KEY_SHIFT or MOESERVE_KV_KEY_ROUNDING: 1 (the default) or 0."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value}: expected 1 or 0")
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


def attention_layers(model: nn.Module) -> list[Attention]:
    """The decoder layers' plain (not MLA) attention modules."""
    layers = (getattr(layer, "attn", None) for layer in getattr(model, "layers", ()))
    return [a for a in layers if isinstance(a, Attention)]


def prepare(model: nn.Module, device: torch.device, shift: bool, rounding: bool) -> None:
    """Gives each layer its buffers before the backend is installed (the fused decode step
    takes their addresses; calibrate() fills them in place): a zero shift [G, d] where the
    layer has no sinks, and a rounding factor [G, d, d] that starts as the identity (plain
    rounding), all float32."""
    for attn in attention_layers(model):
        g, d = attn.num_kv_heads, attn.head_dim
        if shift and attn.attn.sinks is None:
            attn.attn.key_shift = torch.zeros(g, d, dtype=torch.float32, device=device)
        if rounding:
            eye = torch.eye(d, dtype=torch.float32, device=device)
            attn.attn.key_hinv = eye.expand(g, d, d).contiguous()


@torch.no_grad()
def calibrate(model: nn.Module, kv_caches: list, token_ids: list[int]) -> int:
    """One prefill of token_ids through the model, into kv_caches (a scratch cache of the
    model's dtype, at least as many slots as tokens); then each prepared layer's shift becomes
    its keys' mean, and its rounding factor its queries', over the positions after the first
    SKIPPED_POSITIONS. Returns the tokens used (0: too few; the buffers stay as prepare()
    left them)."""
    n = len(token_ids)
    layers = [
        a.attn
        for a in attention_layers(model)
        if a.attn.key_shift is not None or a.attn.key_hinv is not None
    ]
    if not layers or n <= 2 * SKIPPED_POSITIONS:
        return 0
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def recording(paged: PagedAttention):
        write = paged.rope_and_write

        def rope_and_write(qkv, cos, sin, meta, k_cache, v_cache):
            q, k, v = write(qkv, cos, sin, meta, k_cache, v_cache)
            seen[id(paged)] = q[SKIPPED_POSITIONS:].float(), k[SKIPPED_POSITIONS:].float()
            return q, k, v

        return rope_and_write

    for paged in layers:  # an instance attribute over the method, for this pass only
        paged.rope_and_write = recording(paged)
    device = next(model.parameters()).device
    try:
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            num_decode=0,
            decode_slots=None,
            decode_mask=None,
            prefills=[PrefillChunk(start=0, length=n, context_len=0, slots=None)],
        )
        positions = torch.arange(n, device=device)
        model(torch.tensor(token_ids, device=device), positions, meta, kv_caches)
    finally:
        for paged in layers:
            del paged.rope_and_write
    for paged in layers:
        q, k = seen[id(paged)]
        if paged.key_shift is not None:
            paged.key_shift.copy_(k.mean(dim=0))
        if paged.key_hinv is not None:
            g, d = paged.key_hinv.shape[:2]
            heads = rotate(q).view(q.shape[0], g, -1, d).transpose(0, 1).reshape(g, -1, d)
            paged.key_hinv.copy_(torch.stack([rounding_factor(h) for h in heads]))
    return n


def rounding_factor(queries: torch.Tensor) -> torch.Tensor:
    """Rotated queries [n, d] -> the upper Cholesky factor of (H + damping)^-1, H = their
    second moment, float32 [d, d] (GPTQ's Hinv); the identity where they are all zero."""
    q = queries.double()
    h = q.T @ q / q.shape[0]
    level = h.diagonal().mean()
    if level <= 0:
        return torch.eye(q.shape[1], dtype=torch.float32, device=q.device)
    h += DAMPING * level * torch.eye(q.shape[1], dtype=h.dtype, device=h.device)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()
