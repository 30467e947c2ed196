"""8-bit and 4-bit weights applied to a plain model from outside (as gpt-fast's quantize.py
does): every attention projection, expert and dense MLP, and the lm_head if asked; with int8
and int4 the embedding table too, in int8 (a scale per row). int4 keeps the lm_head in int8,
as llama.cpp's Q4_K_M keeps its output layer at 6 bits: the logits take its error whole. Routers and norms stay in the model's dtype, as does MLA's
kv_b_proj (the absorbed projections are derived from it). The modules installed here run
quantization/qweight.py's torch path; on the CPU kernels executor/cpu_backend.py replaces them
again with the same weights packed.

int4's choices (Int4Choices, bench/NOTES.md measures each on SmolLM2): groups of 128 inputs,
rotated rows, levels, scales and integer zero points by quantization/int4_search.py's search
(llama.cpp's Q4_K fit); with `wide`, the projections llama.cpp's Q4_K_M keeps at 6 bits
(attn_v, ffn_down) kept int8 here: the fused q/k/v and the dense down projection, of every
layer by default, or only of the layers Q4_K_M's use_more_bits picks (stacked experts stay
4-bit: one format a stack). Every layer's: SmolLM2's perplexity +11.1% where use_more_bits'
gives +21.2%, for 8.7% more weight bytes on that dense model and about 0.8% on the medium MoE
preset, whose bytes are nearly all experts. The MOESERVE_INT4_* variables switch each choice,
to measure it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from inference.executor.module_swap import swap_modules
from inference.models.layers import Linear
from inference.models.moe import Experts, grouped_dispatch, swiglu
from inference.quantization import qweight as quant
from inference.quantization.hadamard import rotate_by_products
from inference.quantization.int4_search import METHODS, quantize_int4_searched
from inference.quantization.qweight import QWeight


class QuantLinear(nn.Module):
    """A linear layer of an 8-bit weight (QWeight, row-major) and an optional bias."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant.linear(x, self.weight, self.bias)


class QuantExperts(nn.Module):
    """Stacked experts of 8-bit weights: one expert at a time (grouped dispatch); the plain
    experts' biases and activation (gpt-oss's) kept as they were."""

    def __init__(self, w13: QWeight, w2: QWeight, plain: Experts) -> None:
        super().__init__()
        self.w13, self.w2 = w13, w2
        self.b13, self.b2, self.glu = plain.b13, plain.b2, plain.glu
        self.num_experts = w13.scale.shape[0]

    def forward(self, x, weights, ids) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        glu = self.glu or swiglu
        out = grouped_dispatch(
            x, weights, ids, counts, self.w13, self.w2, quant.linear, self.b13, self.b2, glu
        )
        return out, counts


class QuantEmbedding(nn.Module):
    """An int8 embedding table, a scale per row, stored rotated as every int8 weight
    (quant.quantize_int8): looked-up rows are dequantized and rotated back, in the model's
    dtype."""

    def __init__(self, table: QWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # index_select: 2.5x faster than advanced indexing for a 2,048-token chunk on CPU
        flat = ids.reshape(-1)
        rows = self.weight.data.index_select(0, flat).float()
        rows.mul_(self.weight.scale[0].index_select(0, flat).unsqueeze(-1))
        return rotate_by_products(rows).to(self.dtype).view(*ids.shape, -1)


@dataclass(frozen=True)
class Int4Choices:
    group: int = quant.INT4_GROUP
    method: str = "search"  # int4_search.METHODS
    rotated: bool = True
    # int8 for the sensitive projections (see the module docstring): "all" (every layer's),
    # "layers" (use_more_bits's), "none"
    wide: str = "all"

    @classmethod
    def from_environ(cls) -> Int4Choices:
        """The defaults, or MOESERVE_INT4_GROUP / _METHOD / _ROTATE / _WIDE (bench/quant_bench.py's
        int4 rows measure each)."""
        env, base = os.environ, cls()
        method = env.get("MOESERVE_INT4_METHOD", base.method)
        if method not in METHODS:
            raise ValueError(f"MOESERVE_INT4_METHOD={method}: expected one of {', '.join(METHODS)}")
        wide = env.get("MOESERVE_INT4_WIDE")
        if wide is not None and wide not in _WIDE_SWITCH:
            raise ValueError(f"MOESERVE_INT4_WIDE={wide}: expected all, 1 or 0")
        group = env.get("MOESERVE_INT4_GROUP", str(base.group))
        if not group.isdigit() or int(group) % 8:
            raise ValueError(f"MOESERVE_INT4_GROUP={group}: expected a multiple of 8")
        return cls(
            int(group),
            method,
            env.get("MOESERVE_INT4_ROTATE", "1" if base.rotated else "0") != "0",
            base.wide if wide is None else _WIDE_SWITCH[wide],
        )


# MOESERVE_INT4_WIDE's values: every layer's (the default), use_more_bits' layers, none
_WIDE_SWITCH = {"all": "all", "1": "layers", "0": "none"}


def uses_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the first and last eighth of the layers
    and every third between, the layers whose attn_v and ffn_down Q4_K_M widens."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


_SENSITIVE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:attn\.wqkv|mlp\.w2)$")


def kept_wide(name: str, layers: int, wide: str = Int4Choices.wide) -> bool:
    """Whether int4 keeps this Linear in int8 (Int4Choices.wide)."""
    found = _SENSITIVE.search(name) if wide != "none" else None
    return found is not None and (wide == "all" or uses_more_bits(int(found.group(1)), layers))


def quantize_model(
    model: nn.Module,
    fmt: str,
    published: dict[str, QWeight],
    lm_head: bool = True,
    only_published: bool = False,
) -> None:
    """Installs quantized weights (int8, int4 or fp8), once after loading. `published`: fp8 weights as the
    checkpoint shipped them (parameter name -> row-major QWeight), used as they are; with
    only_published, what the checkpoint kept in 16 bits stays so."""

    choices = Int4Choices.from_environ() if fmt == "int4" else None
    layers = sum(
        1 for name, _ in model.named_modules() if re.fullmatch(r"(.*\.)?layers\.\d+", name)
    )

    def weight(name: str, w: torch.Tensor, wide: bool = False) -> QWeight | None:
        """wide: int4 keeps it int8 (the lm_head, the sensitive projections)."""
        kept = published.get(name) if fmt == "fp8" or only_published else None
        if kept is None and only_published:
            return None
        if kept is not None:
            return kept
        if fmt == "int4" and not wide:
            return quantize_int4_searched(w.data, choices.group, choices.method, choices.rotated)
        return quant.quantize(w.data, "int8" if fmt == "int4" else fmt)

    def replace(name: str, module: nn.Module, parent: nn.Module) -> nn.Module | None:
        if type(module) is Linear:  # not its subclasses: routers stay in the model's dtype
            if name.endswith("attn.wkv_b") or (name == "lm_head" and not lm_head):
                return None
            wide = name == "lm_head" or (fmt == "int4" and kept_wide(name, layers, choices.wide))
            w = weight(f"{name}.weight", module.weight, wide)
            return None if w is None else QuantLinear(w, module.bias)
        if isinstance(module, Experts):
            w13, w2 = weight(f"{name}.w13", module.w13), weight(f"{name}.w2", module.w2)
            return None if w13 is None or w2 is None else QuantExperts(w13, w2, module)
        if isinstance(module, nn.Embedding) and fmt in ("int8", "int4"):
            return QuantEmbedding(quant.quantize_int8(module.weight.data), module.weight.dtype)
        return None

    swap_modules(model, replace)
