"""Checks the third-wave family tests share: noaux_tc routing against a transformers router, and
a checkpoint variant refused at load naming its config field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from inference import LLMEngine, ModelLoadError


def check_routing_against_reference(ours, ref, experts: int, top_k: int) -> torch.Tensor:
    """Our NoAuxMoE `ours` and a transformers router `ref` over the same random gate and
    correction bias (the bias held by `ref`, or passed to it as MiniMax-M2's takes it): the
    same experts and weights for 64 tokens, and the bias moved the choice for some (else the
    check would prove little). Returns our weights [64, top_k]."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(experts, 32, generator=g))
        bias = torch.rand(experts, generator=g) * 0.5
        ours.gate.weight.copy_(ref.weight)
        ours.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        weights, ids = ours.route(x)
        if hasattr(ref, "e_score_correction_bias"):
            ref.e_score_correction_bias.copy_(bias)
            _, ref_weights, ref_ids = ref(x)
        else:
            _, ref_weights, ref_ids = ref(x, bias)
        unbiased = torch.sigmoid(x @ ref.weight.T).topk(top_k, dim=-1).indices
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    )
    assert not torch.equal(order.values, unbiased.sort(dim=-1).values)  # the bias mattered
    return weights


def check_variant_refused(src: Path, out: Path, change: dict, field: str) -> None:
    """A copy of checkpoint `src` in `out` with `change` in its config.json is refused at load
    with an error naming `field`."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ModelLoadError, match=field):
        LLMEngine.from_pretrained(out, device="cpu", dtype="float32", kv_cache_tokens=64)
