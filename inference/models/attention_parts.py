"""Attention over a context in parts, merged by their log-sum-exp: a prompt chunk after a
cached prefix attends to the prefix (no mask: every query sees every earlier key) and to
itself (causally) in two flash-attention calls, never building a mask or scores as wide as
the context. Sliding windows keep to the keys a window can reach (masks at most chunk x
window); attention sinks join the merge as one more part with no value.

Shapes: B batch, H query heads, G kv heads (H % G == 0), c queries, n keys, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# keys per block of the device-independent loop (its scores: H x c x KEY_BLOCK floats)
KEY_BLOCK = 1024


def attend_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, c, d] over k, v [B, G, n, d] -> (out [B, H, c, dv] in q's dtype, logsumexp
    [B, H, c] float32 of the scaled scores). causal: query i sees keys [0, i]; bias [c, n]
    in q's dtype: added to the scores (-inf: not seen). Every query must see some key (a
    fully masked row has no logsumexp). On the CPU, ATen's flash kernel (the one SDPA runs,
    the only one returning the logsumexp there); elsewhere a loop over key blocks."""
    dk, dv = q.shape[-1], v.shape[-1]
    if q.device.type != "cpu":
        return blocked_lse(q, k, v, scale, causal, bias)
    if dv != dk:  # the kernel wants one head width: zeros widen the narrower side
        width = max(dk, dv)
        q, k = F.pad(q, (0, width - dk)), F.pad(k, (0, width - dk))
        v = F.pad(v, (0, width - dv))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out[..., :dv], lse


def blocked_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    block: int = KEY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_lse in plain torch on any device: an online softmax over blocks of `block`
    keys, in float32; the query heads of a kv head share its blocks (no repeated keys)."""
    b, h, c, dk = q.shape
    g, n, dv = k.shape[1], k.shape[2], v.shape[-1]
    qf = q.float().view(b, g, h // g, c, dk) * scale
    top = q.new_full((b, g, h // g, c, 1), float("-inf"), dtype=torch.float32)
    total = torch.zeros_like(top)
    acc = q.new_zeros((b, g, h // g, c, dv), dtype=torch.float32)
    rows = torch.arange(c, device=q.device)[:, None]
    for k0 in range(0, n, block):
        k1 = min(n, k0 + block)
        scores = qf @ k[:, :, k0:k1].float().unsqueeze(2).transpose(-1, -2)
        if causal:
            scores.masked_fill_(torch.arange(k0, k1, device=q.device) > rows, float("-inf"))
        if bias is not None:
            scores += bias[:, k0:k1].float()
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
        safe = torch.where(new_top.isinf(), 0.0, new_top)  # rows that saw nothing yet
        p = torch.exp(scores - safe)
        rescale = torch.exp(top - safe)
        total = total * rescale + p.sum(-1, keepdim=True)
        acc = acc * rescale + p @ v[:, :, k0:k1].float().unsqueeze(2)
        top = new_top
    out = (acc / total).view(b, h, c, dv).to(q.dtype)
    return out, (top + total.log()).view(b, h, c)


def merge(
    parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Softmax-weighted sum of parts (out [B, H, r, dv], lse [B, H, r]) over the same queries,
    a part covering only the first r rows of the first part's; sinks [H]: a logit per head
    in each denominator with no value (gpt-oss). -> [B, H, c, dv] in dtype."""
    first_out, first_lse = parts[0]
    lse = first_lse.clone()
    for _, part_lse in parts[1:]:  # the running max over the parts (and sinks)
        r = part_lse.shape[-1]
        lse[..., :r] = torch.maximum(lse[..., :r], part_lse)
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1)
        lse = torch.maximum(lse, sink)
    weight = torch.exp(first_lse - lse)
    out = first_out.float() * weight.unsqueeze(-1)
    denominator = weight
    for part_out, part_lse in parts[1:]:
        r = part_lse.shape[-1]
        w = torch.exp(part_lse - lse[..., :r])
        out[..., :r, :] += part_out.float() * w.unsqueeze(-1)
        denominator[..., :r] += w
    if sinks is not None:
        denominator = denominator + torch.exp(sink - lse)
    return (out / denominator.unsqueeze(-1)).to(dtype)


def window_bias(
    queries: int, keys: int, offset: int, window: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """[queries, keys] additive mask: query i at position offset + i sees key j (position j)
    when j <= offset + i and j > offset + i - window (window 0: no lower bound)."""
    i = torch.arange(queries, device=device)[:, None] + offset
    j = torch.arange(keys, device=device)[None, :]
    hidden = j > i
    if window:
        hidden |= j <= i - window
    return torch.zeros((queries, keys), dtype=dtype, device=device).masked_fill(
        hidden, float("-inf")
    )


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prev: torch.Tensor | None,
    v_prev: torch.Tensor | None,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk's queries q [B, H, c, d] over its own keys k, v [B, G, c, d] (the same
    positions) and the n keys just before them k_prev, v_prev [B, G, n, d] (None: none; with
    a window, at most window - 1 of them are read). window > 0: each query sees its last
    `window` positions, itself included. sinks [H] or None. -> [B, H, c, dv] in q's dtype."""
    c = q.shape[2]
    n = 0 if k_prev is None else k_prev.shape[2]
    banded = window and c > window
    if not n and not banded and sinks is None:  # one causal part: SDPA's own kernel, any device
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if window and n > window - 1:
        k_prev, v_prev, n = (
            k_prev[:, :, n - window + 1 :],
            v_prev[:, :, n - window + 1 :],
            window - 1,
        )
    # the queries that see some earlier key: all of them, or with a window the first
    # window - 1 (query i reaches back to position i - window + 1 of the chunk)
    rows = min(c, window - 1) if window else c
    earlier = bool(n and rows > 0)
    # Parts to merge leave their kernel rounded to its dtype. The chunk's own part (c x c:
    # small) runs in float32 then, so a fresh prompt with sinks rounds once, as one SDPA
    # call did (bf16 logits moved on a near tie otherwise); the part over the prefix, the
    # context-wide work, keeps the model's dtype and its kernel's rate.
    merging = earlier or sinks is not None
    own_dtype = torch.float32 if merging and q.element_size() < 4 else q.dtype
    qo, ko, vo = q.to(own_dtype), k.to(own_dtype), v.to(own_dtype)
    if banded:  # the chunk over itself: a band
        own = attend_lse(qo, ko, vo, scale, bias=window_bias(c, c, 0, window, own_dtype, q.device))
    else:
        own = attend_lse(qo, ko, vo, scale, causal=True)
    if not merging:
        return own[0]
    parts = [own]
    if earlier:
        bias = None
        if window and n + rows - 1 >= window:  # some earlier key out of some query's window
            bias = window_bias(rows, n, n, window, q.dtype, q.device)
        parts.append(attend_lse(q[:, :, :rows], k_prev, v_prev, scale, bias=bias))
    return merge(parts, sinks, q.dtype)
