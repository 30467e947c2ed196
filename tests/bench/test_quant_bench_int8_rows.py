"""quant_bench's int8 rows with an activation scale per 32 inputs (issue 40): the switch they
run under changes what the int8 products compute for the block, kernels and torch reference
alike, and gives the start-up choice back after."""

from __future__ import annotations

import pytest
import torch

from bench import quant_bench
from inference.kernels import cpu as cpu_kernels
from inference.quantization import hadamard
from inference.quantization import qweight as quant


def test_an_act_group_block_switches_the_int8_products_then_restores_them():
    if cpu_kernels.enable_once() is None:
        pytest.skip("no CPU kernels on this machine")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 256, generator=g).bfloat16()
    x[:, :32] *= 40  # one loud group: a scale per 32 inputs keeps the rest finer
    qw = quant.quantize_int8(torch.randn(48, 256, generator=g) * 0.05)
    packed = cpu_kernels.pack_qweight(qw)
    before = quant.INT8_ACT_GROUP
    with quant_bench.int8_act_group(0):
        assert quant.INT8_ACT_GROUP == 0
        row_scale = cpu_kernels.linear(x, packed)
        q, sx = quant.quantize_rows(hadamard.rotate(x.float()))
        exact = (q.double() @ qw.data.double().t()) * sx.double()[:, None] * qw.scale[0].double()
        torch.testing.assert_close(row_scale.float(), exact.float(), rtol=2**-7, atol=2**-7)
    assert quant.INT8_ACT_GROUP == before
    with quant_bench.int8_act_group(32):
        grouped = cpu_kernels.linear(x, packed)
        assert not torch.equal(grouped, row_scale)
    assert torch.equal(cpu_kernels.linear(x, packed), grouped if before == 32 else row_scale)


def test_the_act32_rows_are_int8_rows_with_groups_of_32():
    for name in ("int8_weights_act32", "int8_weights_kv_act32"):
        options = quant_bench.ACCURACY_CONFIGS[name]
        assert options["quantization"] == "int8" and options["int8_act_group"] == 32
    assert set(quant_bench.DEFAULT_SPEED) <= set(quant_bench.SPEED_CONFIGS)
    assert quant_bench.SPEED_CONFIGS["int8_act32"]["int8_act_group"] == 32
