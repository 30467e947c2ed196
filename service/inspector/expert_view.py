"""The inspector's expert view: a window's [MoE layer, expert] routed-token counts with a
per-layer summary (busiest experts, max/mean), so a 58 x 256 (DeepSeek-V3) or 60 x 384
(Kimi-K2) model reads as one line per layer beside the full grid. The grid itself is every
expert's count: the in-process dump the metrics leave out past their series limit.
"""

from __future__ import annotations

import numpy as np

from service.inspector.schemas import InspectorExpertLayer, InspectorExperts, InspectorHotExpert

TOP_EXPERTS = 8  # busiest experts listed per layer (DeepSeek-V3 routes each token to 8)


def experts_view(counts: np.ndarray, window_s: int) -> InspectorExperts:
    """`counts`: [MoE layers, experts] tokens routed in the last `window_s` seconds."""
    num_layers, num_experts = counts.shape
    total = counts.sum(axis=1)
    busiest = np.argsort(-counts, axis=1, kind="stable")[:, : min(TOP_EXPERTS, num_experts)]
    busiest_tokens = np.take_along_axis(counts, busiest, axis=1)
    peak = counts.max(axis=1, initial=0)
    imbalance = np.divide(
        peak * num_experts, total, out=np.zeros(num_layers), where=total > 0
    ).round(3)
    layers = [
        InspectorExpertLayer(
            layer=layer,
            tokens=routed,
            imbalance=ratio,
            top=[InspectorHotExpert(expert=e, tokens=t) for e, t in zip(ids, got) if t > 0],
        )
        for layer, (routed, ratio, ids, got) in enumerate(
            zip(total.tolist(), imbalance.tolist(), busiest.tolist(), busiest_tokens.tolist())
        )
    ]
    return InspectorExperts(
        window_s=window_s, num_experts=num_experts, tokens=counts.tolist(), layers=layers
    )
