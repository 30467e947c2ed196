"""Act-order 4-bit weights (GPTQ's desc_act: a g_idx whose groups are not contiguous inputs)
served in 4 bits, as exllama, Marlin and vLLM serve them: each weight's inputs sorted by
group at load (gptq.unpack's Int4Levels.perm, then QWeight.perm), its activations gathered into that order at run
time (y = W x = W[:, perm] x[perm]).

An MLP's down projection needs no gather: its input is the gate/up projection's output,
whose rows (quantized per output row: each row's scales and zero points go with it) are
put in the down projection's input order at load instead (fold_down_order)."""

from __future__ import annotations

import dataclasses

import torch

from inference.quantization.qweight import QWeight


def permute_outputs(w: QWeight, rows: torch.Tensor) -> QWeight:
    """A row-major 4-bit weight [..., N, K] with its output rows in the order `rows` [..., N]
    gives (row n of the result is row rows[n]), scales and zero points alike."""
    rows = rows.long()
    data = w.data.gather(-2, rows.unsqueeze(-1).expand_as(w.data))
    columns = rows.unsqueeze(-2).expand_as(w.scale)  # scales and zeros are [..., G, N]
    scale = w.scale.gather(-1, columns)
    zero = None if w.zero is None else w.zero.gather(-1, columns).contiguous()
    return dataclasses.replace(w, data=data.contiguous(), scale=scale.contiguous(), zero=zero)


def fold_down_order(w13: QWeight, w2: QWeight) -> tuple[QWeight, QWeight]:
    """An MLP's (or a stack of experts') fused gate/up weight w13 [..., 2I, K] and down
    projection w2 [..., D, I] with an act-order perm [..., I] -> the same MLP with w2's perm
    folded into w13's rows: gate and up rows both in w2's input order, so silu(gate) * up
    comes out gathered already (SwiGLU pairs gate i with up i, whatever the order)."""
    perm = w2.perm.long()
    inter = perm.shape[-1]
    if w13.out_features != 2 * inter:
        raise ValueError(f"gate/up has {w13.out_features} rows, the down projection {inter} inputs")
    rows = torch.cat((perm, perm + inter), dim=-1)
    return permute_outputs(w13, rows), dataclasses.replace(w2, perm=None)
