"""The block Hadamard rotation both 8-bit formats store their values in: a row times the
normalized Hadamard matrix of each power-of-two block of its width, largest first (576 =
512 + 64), an orthogonal map that is its own inverse. A few large channels (keys' outliers,
activations' outliers) become a share in every value, so 8-bit rounding, relative to a row's
or a value's size, costs much less: the KV cache's rows (models/paged_cache.py) and int8
weights and activations (qweight.py; QuaRot's observation, arXiv 2404.00456).
kernels/csrc/hadamard.c's hadamard_rotate is the same butterflies in the same order: both give
the same floats."""

from __future__ import annotations

import functools
import math

import torch


def rotation_blocks(n: int) -> list[int]:
    """The power-of-two blocks of a row of n values that rotate() mixes, largest first."""
    return [1 << bit for bit in range(n.bit_length() - 1, -1, -1) if n >> bit & 1]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """float32 rows [..., n] times the normalized Hadamard matrix of each power-of-two block
    of n, largest first; its own inverse. The butterflies and the scale of csrc
    hadamard_rotate, in its order, so both give the same floats."""
    parts, off = [], 0
    for b in rotation_blocks(x.shape[-1]):
        y, h = x[..., off : off + b], 1
        while h < b:
            pairs = y.unflatten(-1, (b // (2 * h), 2, h))
            a, c = pairs[..., 0, :], pairs[..., 1, :]
            y, h = torch.stack((a + c, a - c), dim=-2).flatten(-3), 2 * h
        parts.append(y * torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32, device=x.device))
        off += b
    return torch.cat(parts, dim=-1)


def rotate_by_products(x: torch.Tensor) -> torch.Tensor:
    """rotate() up to float rounding, through matrix products: each block of b = b1 * b2 is
    H_b1 (x) H_b2 (Sylvester's construction), so its rows rotate as H_b1 X H_b2 with X the
    row as [b1, b2], 2 * sqrt(b) products a value where the butterflies make log2(b) passes
    over memory. Where the rounding need not be the kernels' (weights at load, the int8
    embedding's rows off the CPU kernels): a layer of the demo model's experts,
    [8, 2048, 512], in 0.08 s, not 0.57; a decode step's 32 embedding rows in 0.08 ms, not
    0.64."""
    parts, off = [], 0
    rows = x.float().reshape(-1, x.shape[-1])
    for b in rotation_blocks(x.shape[-1]):
        b1 = 1 << (b.bit_length() - 1) // 2
        h1, h2 = rotation_matrix(b1, x.device), rotation_matrix(b // b1, x.device)
        block = rows[:, off : off + b].reshape(-1, b1, b // b1)
        parts.append(torch.matmul(h1, block @ h2).reshape(-1, b))
        off += b
    return torch.cat(parts, dim=-1).reshape(x.shape)


@functools.cache
def rotation_matrix(n: int, device: torch.device) -> torch.Tensor:
    """rotate() as a float32 matrix, x @ it == rotate(x) up to rounding: one product where
    reads rotate many rows back (the writes keep rotate(), the C kernels' exact floats)."""
    return rotate(torch.eye(n, device=device))
