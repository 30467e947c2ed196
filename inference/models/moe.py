"""Mixture-of-experts routing and dispatch.

Shapes: T tokens, D hidden, E experts, A experts per token (top-k), I expert FFN width.
Expert weights are stacked per projection: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].

A layer is a router (Router: which experts each token goes to, with which weights) and the
experts (Experts: their stacked weights and the dispatch of tokens to them). Backends replace
the Experts from outside: the CPU kernels run a whole layer in one call for any number of
tokens (kernels/modules.py), 8-bit experts take executor/quantize.py's. In torch, four
dispatch paths, same result:
- gather (gpt-fast): each token gathers its A experts' weights and runs one batched matmul.
  No host sync and a fixed op count, so it suits small decode batches on a GPU; it copies
  T*A expert matrices, which is why it is not used for large batches.
- padded (CPU decode batches): (token, expert) pairs sorted by expert into an [E, C, D]
  buffer, two bmm over all experts.
- grouped: (token, expert) pairs sorted by expert, one matmul per expert that received
  tokens, on contiguous slices and weight views (no weight copies). Its loop is over experts,
  never tokens. On CPU the per-expert counts cost nothing to read: large prefills take this
  path.
- single token (CPU decode of one sequence): its A experts one after the other, a dozen ops.
dispatch_path() names the path a step takes; dispatch(path=...) and Experts(dispatch_path=...)
force one (tests/inference/test_moe_dispatch.py holds them all equal, the C kernels too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.models.layers import Linear, linear


def select_experts(
    probs: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    num_groups: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router probabilities [T, E] -> top-A weights and expert ids [T, A].

    num_groups > 1 is DeepSeek-V2's group-limited greedy routing: each group of E/num_groups
    consecutive experts scores as its best expert, and only the topk_group best groups may be
    chosen from. `scaling` is the routed_scaling_factor, applied after the optional
    renormalisation."""
    if num_groups > 1:
        grouped = probs.view(probs.shape[0], num_groups, -1)
        groups = grouped.amax(dim=-1).topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, groups, True)
        probs = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(probs)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids


# Up to this many (token, expert) pairs a step uses padded_dispatch on CPU (decode batches,
# short prefill chunks); larger prefills go through grouped_dispatch, whose matmuls are big
# enough on their own.
_PADDED_MAX_ROUTED = 512
DISPATCH_PATHS = ("gather", "single_token", "padded", "grouped")


def gather_limit(device_type: str) -> int:
    """Up to how many tokens the engine's MoE layers take the gather path on this device: 8
    on a GPU (no host sync, a fixed number of ops), none on the CPU."""
    return 8 if device_type == "cuda" else 0


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class ClampedSwiGLU:
    """gpt-oss's expert activation on [..., 2I] (gate then up): the gate clamped above and the
    up projection on both sides at `limit`, gate * sigmoid(alpha * gate) * (up + 1)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def dispatch_path(
    num_tokens: int, num_routed: int, num_experts: int, device_type: str, gather_max_tokens: int
) -> str:
    """The path (one of DISPATCH_PATHS) dispatch() takes for a step of `num_tokens` tokens
    routed to `num_routed` (token, expert) pairs on this device type."""
    if num_tokens <= gather_max_tokens:
        return "gather"
    if device_type == "cpu":
        if num_tokens == 1:
            return "single_token"
        if num_experts <= num_routed <= _PADDED_MAX_ROUTED:
            return "padded"
    return "grouped"


def dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gather_max_tokens: int,
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed tokens -> the MoE output [T, D] and the per-expert token counts [E]. `path`
    forces one of DISPATCH_PATHS; None chooses by size and device (dispatch_path)."""
    flat = ids.flatten()
    # not bincount: on CUDA it reads the largest id back to the host, a sync in every layer
    counts = flat.new_zeros(w13.shape[0]).scatter_add_(0, flat, torch.ones_like(flat))
    if path is None:
        path = dispatch_path(
            x.shape[0], ids.numel(), w13.shape[0], x.device.type, gather_max_tokens
        )
    if path == "gather":
        return gather_dispatch(x, weights, ids, w13, w2), counts
    if path == "single_token":
        return single_token_dispatch(x, weights, ids, w13, w2), counts
    if path == "padded":
        return padded_dispatch(x, weights, ids, counts, w13, w2), counts
    if path == "grouped":
        return grouped_dispatch(x, weights, ids, counts, w13, w2), counts
    raise ValueError(f"unknown MoE dispatch path {path!r}; choose from {', '.join(DISPATCH_PATHS)}")


def gather_dispatch(x, weights, ids, w13, w2) -> torch.Tensor:
    h = swiglu(torch.einsum("td,tahd->tah", x, w13[ids]))  # w13[ids]: [T, A, 2I, D]
    y = torch.einsum("tai,tadi->tad", h, w2[ids])
    return torch.einsum("tad,ta->td", y, weights.to(y.dtype))


def single_token_dispatch(x, weights, ids, w13, w2) -> torch.Tensor:
    """One token on the CPU: its A experts one after the other, in expert order (the
    reference's summation order), four kernels each: w13 GEMV, SiLU, gate * up, and the
    w2 GEMV accumulating weight * output into the result (addmv)."""
    if x.shape[0] != 1:
        raise ValueError(f"single_token_dispatch takes one token, got {x.shape[0]}")
    out = torch.zeros_like(x[0])
    for expert, weight in sorted(zip(ids[0].tolist(), weights[0].tolist())):
        gate, up = torch.mv(w13[expert], x[0]).chunk(2)
        out.addmv_(w2[expert], F.silu(gate).mul_(up), alpha=weight)
    return out.unsqueeze(0)


def padded_dispatch(x, weights, ids, counts, w13, w2) -> torch.Tensor:
    """Decode batches: tokens sorted by expert into an [E, C, D] buffer (C: the busiest
    expert's load), then two batched matmuls over all experts. At this size the experts
    are memory-bound and every one is hit; one bmm streams their weights faster than E
    small matmuls (15% on our CPUs) and costs a fixed number of ops."""
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    sorted_ids = flat_ids[order]
    token_of = order // top_k
    starts = counts.cumsum(0) - counts
    slot = torch.arange(flat_ids.numel(), device=x.device) - starts[sorted_ids]
    buf = x.new_zeros(w13.shape[0], int(counts.max()), x.shape[1])
    buf[sorted_ids, slot] = x[token_of]
    h = swiglu(torch.bmm(buf, w13.transpose(1, 2)))
    ys = torch.bmm(h, w2.transpose(1, 2))[sorted_ids, slot]  # [T*A, D], expert order
    ys *= weights.flatten()[order].to(ys.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


def grouped_dispatch(
    x, weights, ids, counts, w13, w2, product=linear, b13=None, b2=None, activation=swiglu
) -> torch.Tensor:
    """Large batches: one product per expert that received tokens (`product`: x, one expert's
    weight -> x W^T; 8-bit experts pass their own). Experts with biases (b13 [E, 2I], b2
    [E, D]) or another activation (gpt-oss's) take this path at every size."""
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    xs = x[token_of]  # [T*A, D], grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            end = start + n
            h = product(xs[start:end], w13[expert])
            h = activation(h if b13 is None else h + b13[expert])
            y = product(h, w2[expert])
            ys[start:end] = y if b2 is None else y + b2[expert]
            start = end
    ys *= weights.flatten()[order].to(ys.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


# The dispatch as one opaque op for torch.compile: its paths read expert counts on the host,
# which would split the compiled graph at every MoE layer.
@torch.library.custom_op("moeserve::moe_dispatch", mutates_args=())
def dispatch_op(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gather_max_tokens: int,
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch(x, weights, ids, w13, w2, gather_max_tokens, path)


@dispatch_op.register_fake
def _(x, weights, ids, w13, w2, gather_max_tokens, path=None):
    return torch.empty_like(x), x.new_empty(w13.shape[0], dtype=torch.long)


class Router(Linear):
    """The gate: hidden [T, D] -> expert logits [T, E]; in float32 where the reference routes
    in float32 (DeepSeek-V2), whatever the model's dtype; with a bias where the checkpoint has
    one (gpt-oss)."""

    def __init__(
        self, hidden_size: int, num_experts: int, fp32: bool = False, bias: bool = False
    ) -> None:
        super().__init__(hidden_size, num_experts, bias=bias)
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
        return linear(x, self.weight, self.bias)


class CorrectedRouter(Router):
    """The gate, with the per-expert bias that steers the choice of experts (and not their
    weights): DeepSeek's auxiliary-loss-free load balancing, which GLM-4.5 and MiniMax-M2
    route by too. Both stay float32 in every model dtype, as the references keep them."""

    keep_in_fp32 = True

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts, fp32=True)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class Experts(nn.Module):
    """E SwiGLU experts, stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].
    forward(x [T, D], router weights and ids [T, A]) -> the weighted sum of each token's
    experts [T, D] and the tokens per expert [E]. gpt-oss's experts add biases to both
    projections (b13 [E, 2I], b2 [E, D]) and use a ClampedSwiGLU (`glu`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gather_max_tokens: int = 0,
        dispatch_path: str | None = None,
        bias: bool = False,
        glu: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        if dispatch_path not in (None, *DISPATCH_PATHS):
            raise ValueError(f"unknown MoE dispatch path {dispatch_path!r}")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gather_max_tokens = gather_max_tokens  # use the gather path up to this many tokens
        self.dispatch_path = dispatch_path  # one path forced (None: by size and device)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.glu = glu

    def forward(self, x, weights, ids) -> tuple[torch.Tensor, torch.Tensor]:
        if self.b13 is not None or self.glu is not None:
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
            glu = self.glu or swiglu
            out = grouped_dispatch(
                x, weights, ids, counts, self.w13, self.w2, linear, self.b13, self.b2, glu
            )
            return out, counts
        run = dispatch_op if torch.compiler.is_compiling() else dispatch
        return run(x, weights, ids, self.w13, self.w2, self.gather_max_tokens, self.dispatch_path)


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        gather_max_tokens: int = 0,
        num_groups: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        router_fp32: bool = False,
        dispatch_path: str | None = None,
        router_bias: bool = False,
        expert_bias: bool = False,
        glu: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_groups, self.topk_group = num_groups, topk_group
        self.scaling = routed_scaling_factor
        self.gate = Router(hidden_size, num_experts, router_fp32, router_bias)
        self.experts = Experts(
            num_experts,
            hidden_size,
            intermediate_size,
            gather_max_tokens,
            dispatch_path,
            expert_bias,
            glu,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax router (in float32, as the reference does) -> top-A weights and expert ids."""
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        return select_experts(
            probs, self.top_k, self.norm_topk_prob, self.num_groups, self.topk_group, self.scaling
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MoE output [T, D] and the per-expert token counts [E]."""
        weights, ids = self.route(x)
        return self.experts(x, weights, ids)


class DenseMLP(nn.Module):
    """SwiGLU MLP (dense layers, Qwen2-MoE's shared expert), gate and up fused; optional
    biases (Llama's mlp_bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.w2 = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))


class SharedExpertMoE(nn.Module):
    """Routed experts plus always-on shared experts: Qwen2-MoE scales its shared expert by a
    sigmoid gate, DeepSeek-V2 adds its (n_shared_experts wide) shared MLP as is."""

    def __init__(self, moe: MoE, shared: DenseMLP, gated: bool = True) -> None:
        super().__init__()
        self.moe, self.shared = moe, shared
        hidden = moe.gate.weight.shape[1]
        self.shared_gate = Router(hidden, 1) if gated else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed, counts = self.moe(x)
        if self.shared_gate is None:
            return routed + self.shared(x), counts
        return routed + torch.sigmoid(self.shared_gate(x)) * self.shared(x), counts


class NoAuxMoE(MoE):
    """noaux_tc routing (DeepSeek-V3, GLM-4.5, MiniMax-M2), MoE's arguments: sigmoid scores;
    experts chosen on the scores plus the gate's correction bias, within the best topk_group
    of num_groups groups (a group scores as the sum of its two best; one group: all experts);
    weights from the unbiased scores, optionally renormalised, times routed_scaling_factor.
    Routed in float32."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *args, **kw):
        super().__init__(hidden_size, intermediate_size, num_experts, *args, **kw)
        self.gate = CorrectedRouter(hidden_size, num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> top-A weights [T, A] (float32) and expert ids [T, A]."""
        scores = self.gate(x).sigmoid()  # [T, E], float32
        choice = scores + self.gate.e_score_correction_bias
        if self.num_groups > 1:
            t, e = choice.shape
            groups = choice.view(t, self.num_groups, e // self.num_groups)
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids
