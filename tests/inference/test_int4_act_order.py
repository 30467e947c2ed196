"""Act-order 4-bit weights (GPTQ desc_act, QWeight.perm: column j of the weight is input
perm[j]) on the kernels, each int4 path this CPU runs forced: the linear kernel gathers its
rows as the torch reference does, the MoE kernel each expert's tokens in that expert's
order, the one-call decode step does what the composed layers do, and a down projection's
order folded into gate/up's rows (act_order.fold_down_order) changes no float."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inference.executor import cpu_backend
from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuExperts, CpuLinear
from inference.models.moe import grouped_dispatch, select_experts, swiglu
from inference.quantization import qweight as quant
from inference.quantization.act_order import fold_down_order
from tests.inference.test_int4 import engine
from tests.inference.test_int4_kernel_formats import asymmetric_int4, rows
from tests.inference.test_int4_kernels import (
    INT4_PATHS,
    forced_int4_path,
    fused_step_equals_the_composed_layers,
    path_id,
)


@pytest.fixture(params=INT4_PATHS, ids=path_id)
def int4_path(request):
    yield from forced_int4_path(request.param)


def shuffled(w: quant.QWeight, seed: int) -> quant.QWeight:
    """w as an act-order weight: each matrix's columns read from a random order of inputs
    (a valid act-order weight: its true weight is w's with the columns moved)."""
    g = torch.Generator().manual_seed(seed)
    lead, k = w.scale.shape[:-2], w.in_features
    perms = [torch.randperm(k, generator=g) for _ in range(math.prod(lead))]
    return dataclasses.replace(w, perm=torch.stack(perms).reshape(*lead, k).to(torch.int32))


def test_an_act_order_weight_dequantizes_to_its_inputs_own_order():
    w = asymmetric_int4(torch.randn(24, 96), 32)
    act = shuffled(w, seed=0)
    assert torch.equal(act.dequantize()[:, act.perm.long()], w.dequantize())


@pytest.mark.parametrize("m,n,k,group", [(1, 40, 256, 32), (5, 33, 136, 8), (17, 48, 384, 128)])
def test_int4_linear_gathers_its_rows_as_the_reference(int4_path, m, n, k, group):
    w = asymmetric_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), group)
    act = shuffled(w, seed=k)
    x = rows(m, k, seed=m)
    packed = cpu_kernels.pack_qweight(act)
    y = cpu_kernels.linear(x, packed)
    assert torch.equal(y, quant.linear(x, act))
    # the same floats as the weight in order times the rows gathered by hand
    gathered = x[:, act.perm.long()].contiguous()
    assert torch.equal(y, cpu_kernels.linear(gathered, cpu_kernels.pack_qweight(w)))


@pytest.mark.parametrize("t,d,i,e", [(1, 64, 128, 8), (7, 128, 40, 4), (40, 256, 64, 8)])
def test_moe_gathers_each_experts_tokens_in_its_order(int4_path, t, d, i, e):
    g = torch.Generator().manual_seed(t + d)
    w13, w2 = torch.randn(e, 2 * i, d, generator=g) * 0.1, torch.randn(e, d, i, generator=g) * 0.1
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), 2, True)
    q13, q2 = shuffled(asymmetric_int4(w13, 32), seed=1), asymmetric_int4(w2, 8)
    out, counts = cpu_kernels.moe(
        x, cpu_kernels.pack_qweight(q13), cpu_kernels.pack_qweight(q2), ids, weights
    )
    ref = grouped_dispatch(x, weights, ids, counts, q13, q2, quant.linear).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=float(ref.abs().max()) * 2**-6)
    # every expert in one order: the kernel's floats on the tokens gathered by hand
    one = dataclasses.replace(q13, perm=q13.perm[:1].expand(e, d).contiguous())
    plain = dataclasses.replace(q13, perm=None)
    gathered = x[:, one.perm[0].long()].contiguous()
    args = (cpu_kernels.pack_qweight(q2), ids, weights)
    assert torch.equal(
        cpu_kernels.moe(x, cpu_kernels.pack_qweight(one), *args)[0],
        cpu_kernels.moe(gathered, cpu_kernels.pack_qweight(plain), *args)[0],
    )


def test_a_down_projections_order_folded_into_gate_and_up_changes_no_float():
    g = torch.Generator().manual_seed(3)
    t, d, i, e = 9, 64, 96, 4
    q13 = shuffled(asymmetric_int4(torch.randn(e, 2 * i, d, generator=g), 32), seed=4)
    q2 = shuffled(asymmetric_int4(torch.randn(e, d, i, generator=g), 32), seed=5)
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), 2, True)
    counts = torch.bincount(ids.flatten(), minlength=e)
    f13, f2 = fold_down_order(q13, q2)
    assert f2.perm is None and torch.equal(f13.perm, q13.perm)
    out = grouped_dispatch(x, weights, ids, counts, q13, q2, quant.linear)
    assert torch.equal(grouped_dispatch(x, weights, ids, counts, f13, f2, quant.linear), out)
    # a dense MLP (one matrix each) alike
    d13, d2 = fold_down_order(q13[0], q2[0])
    assert torch.equal(
        quant.linear(swiglu(quant.linear(x, d13)), d2),
        quant.linear(swiglu(quant.linear(x, q13[0])), q2[0]),
    )


def test_the_one_call_decode_step_on_act_order_weights(int4_path, model_dirs):
    """Every attention and dense MLP weight of a qwen2_moe act-order (a random order each),
    the experts' gate/up too: one fused decode step equals the composed layers."""
    eng = engine(model_dirs("qwen2_moe"))
    model = eng.executor.model
    for seed, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, CpuLinear) and name.endswith(
            ("attn.wqkv", "attn.wo", "shared.w13", "shared.w2")
        ):
            w = cpu_kernels.unpack_weight(module.weight, 2 * module.weight.shape[-3]).float()
            del module.weight
            module.weight = cpu_kernels.pack_qweight(shuffled(asymmetric_int4(w, 32), seed))
        elif isinstance(module, CpuExperts):
            for attr, act in (("w13", True), ("w2", False)):
                packed = getattr(module, attr)
                w = asymmetric_int4(
                    cpu_kernels.unpack_weight(packed, 2 * packed.shape[-3]).float(), 32
                )
                delattr(module, attr)
                setattr(module, attr, cpu_kernels.pack_qweight(shuffled(w, seed) if act else w))
    eng.executor.fused_step = cpu_backend.install(model)
    layer = model.layers[0]
    assert layer.attn.wqkv.weight.perm is not None and layer.mlp.moe.experts.w13.perm is not None
    fused_step_equals_the_composed_layers(eng)
