"""The multi-token-prediction layer of DeepSeek-V3 and GLM-4.5 checkpoints (model.layers.N,
N = num_hidden_layers), run as a drafter (speculative method "mtp"), as vLLM's
DeepSeekMultiTokenPredictorLayer / Glm4MoeMultiTokenPredictorLayer run it.

At position i it takes the target's hidden state h_i (the decoder's output, after its final
norm, as vLLM hands it over) and the embedding of token i + 1 (the target's embedding table,
shared as vLLM shares it; zero at position 0), and predicts token i + 2:
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    h = block(x) + its residual          (one decoder layer of the family, its own KV cache)
    logits = shared_head.head(shared_head.norm(h))
(shared_head.head: the target's lm_head where the checkpoint has none, as vLLM shares it.)
Its output h stands in for the target's next hidden state when it drafts further (k > 1).
"""

from __future__ import annotations

import torch
from torch import nn

from inference.models.args import ModelArgs
from inference.models.layers import Linear, RMSNorm

# checkpoint names under model.layers.N that belong to the MTP layer itself (the rest is its
# decoder block, named as any layer's); embed_tokens is the target's (shared, as vLLM does)
MTP_OWN_WEIGHTS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "head_norm.weight",
    "shared_head.head.weight": "head.weight",
}
MTP_SHARED_WEIGHTS = ("embed_tokens.weight",)


class MultiTokenPredictor(nn.Module):
    def __init__(self, args: ModelArgs, layer_class: type[nn.Module], gather_max_tokens: int):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        # the layer index past the target's: MoE unless the config makes it dense
        self.block = layer_class(args, args.num_layers, gather_max_tokens)
        self.head_norm = RMSNorm(d, eps)
        self.head = Linear(d, args.vocab_size, bias=False) if args.mtp_own_head else None

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta,
        cache: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """embeds [T, D] (of each row's next token), previous_hidden [T, D] -> hidden [T, D]."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # vLLM masks it
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        out, residual, _ = self.block(x, None, cos, sin, meta, cache)
        return out + residual

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """`lm_head`: the target's, read where the layer has no head of its own."""
        head = lm_head if self.head is None else self.head
        return head(self.head_norm(hidden))
