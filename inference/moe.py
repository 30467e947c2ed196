"""Mixture-of-experts routing and dispatch.

Shapes: T tokens, D hidden, E experts, A experts per token (top-k), I expert FFN width.
Expert weights are stacked per projection: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].

Two dispatch paths, same result:
- gather (gpt-fast): each token gathers its A experts' weights and runs one batched matmul.
  No host sync and a fixed op count, so it suits small decode batches on a GPU; it copies
  T*A expert matrices, which is why it is not used for large batches.
- grouped: (token, expert) pairs sorted by expert, one matmul per expert that received
  tokens, on contiguous slices and weight views (no weight copies). Its loop is over experts,
  never tokens. On CPU the per-expert counts cost nothing to read, so this is the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, gather_max_tokens: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.intermediate_size = intermediate_size
        self.gather_max_tokens = gather_max_tokens  # use the gather path up to this many tokens
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax router (in float32, as the reference does) -> top-A weights and expert ids."""
        probs = F.linear(x, self.gate).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MoE output [T, D] and the per-expert token counts [E]."""
        weights, ids = self.route(x)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        if x.shape[0] <= self.gather_max_tokens:
            return self.gather_dispatch(x, weights, ids), counts
        return self.grouped_dispatch(x, weights, ids, counts), counts

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up

    def gather_dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13[ids], self.w2[ids]  # [T, A, 2I, D], [T, A, D, I]
        h = self._act(torch.einsum("td,tahd->tah", x, w13))
        y = torch.einsum("tai,tadi->tad", h, w2)
        return torch.einsum("tad,ta->td", y, weights.to(y.dtype))

    def grouped_dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         counts: torch.Tensor) -> torch.Tensor:
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k
        xs = x[token_of]  # [T*A, D], grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if n:
                end = start + n
                ys[start:end] = F.linear(self._act(F.linear(xs[start:end], self.w13[expert])),
                                         self.w2[expert])
                start = end
        ys *= weights.flatten()[order].to(ys.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token_of, ys)


class DenseMLP(nn.Module):
    """SwiGLU MLP (Qwen2-MoE's shared expert and dense layers), gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2)


class SharedExpertMoE(nn.Module):
    """Routed experts plus an always-on shared expert scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, moe: MoE, shared: DenseMLP) -> None:
        super().__init__()
        self.moe, self.shared = moe, shared
        self.shared_gate = nn.Parameter(torch.empty(1, moe.gate.shape[1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed, counts = self.moe(x)
        return routed + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x), counts
