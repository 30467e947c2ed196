"""Layers the model files share, in plain torch: linear projections, RMSNorm and rotary position
embeddings (the rotate-half layout of most checkpoints, over the whole head or its first
part, and the interleaved-pairs layout of DeepSeek's MLA). Backends replace them from outside (executor/cpu_backend.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.models.args import ModelArgs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except one bf16/fp16 row on the CPU runs torch.mv: for a single token 1.3-2.6x
    faster than oneDNN's GEMM (lm_head 0.92 vs 1.44 ms). float32 keeps F.linear, so parity
    tests compare the reference's own kernels."""
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype != torch.float32 and x.device.type == "cpu":
        y = torch.mv(weight, x[0]).unsqueeze(0)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x) * weight. With `residual`: the residual add first, as the decoder layers
        need it (vLLM's fused_add_rms_norm) -> (RMSNorm(x + residual) * weight, x + residual)."""
        if residual is not None:
            x = residual = x + residual
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from transformers' own rope initialisers so scaled
    variants (linear, dynamic-free yarn, llama3) match the reference."""

    keep_in_fp32 = True  # the executor keeps it float32 whatever the model's dtype

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = args.hf_config
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            dim = args.rope_dim
            inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        # positions on the default device (the engine builds the model under torch.device(...)),
        # the scaled initialisers' frequencies brought over from the CPU
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq.float().to(positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; rotate-half convention of the Hugging Face checkpoints. Tables narrower
    than the head (partial rotary: GLM-4.5, MiniMax-M2) rotate its first cos.shape[-1] dims
    and pass the rest, as transformers' apply_rotary_pos_emb does."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; rotates (x[2i], x[2i+1]) pairs, as DeepSeek's view_as_complex does. The
    tables are the rotate-half ones (each frequency twice); their first half is used."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    pairs = x.unflatten(-1, (half, 2))
    xe, xo = pairs[..., 0], pairs[..., 1]
    return torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1).flatten(-2)
