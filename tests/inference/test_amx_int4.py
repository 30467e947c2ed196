"""4-bit weights on AMX int8 tiles (csrc/amx_int4.c, issue 40), forced on amx_emulation.h's
plain-C tiles (any AVX2 CPU) and natively where the CPU has AMX. Products of many rows run on
the tiles and give int4.c's floats, the torch reference's, bit for bit: symmetric and
asymmetric int4, groups of 32, 64, 128 inputs or one per channel, rotated or not, act-order,
mxfp4, a narrow last column block and row counts past whole tiles of 16; the MoE kernel's
outputs are the int4.c path's own bits. (Every other int4 test runs this path too:
test_int4_kernels.INT4_PATHS.)"""

from __future__ import annotations

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from inference.models.moe import select_experts
from inference.quantization import qweight as quant
from tests.inference.test_int4_act_order import shuffled
from tests.inference.test_int4_kernel_formats import asymmetric_int4, mxfp4, rows
from tests.inference.test_int4_kernels import INT4_PATHS, forced_int4_path, path_id

AMX_PATHS = [p for p in INT4_PATHS if p[3].startswith("amx")]


@pytest.fixture(params=AMX_PATHS, ids=path_id)
def amx_path(request):
    yield from forced_int4_path(request.param)


def on_tiles(path: str, m: int, packed: quant.QWeight) -> bool:
    """Whether amx_int4.c runs this product on its tiles (not on its fallback)."""
    lib = cpu_kernels._amx_library(path == "amx-emulated")
    octets = -(-packed.in_features // 8)
    group = min(packed.group, 8 * octets)
    return bool(lib.ms_amx_int4_takes(m, octets, group // 8))


def quantized(w: torch.Tensor, scheme: str, group: int) -> quant.QWeight:
    if scheme == "symmetric":
        return quant.quantize_int4(w, group=group, rotated=False)
    if scheme == "mxfp4":
        return mxfp4(w)
    return asymmetric_int4(w, group, rotated=scheme.endswith("rotated"))


@pytest.mark.parametrize(
    "m,n,k,group",
    # groups of 32 on the grouped tile shape, with a block of 1 column after two whole ones;
    # a last group of one octet (136 = 2 * 64 + 8); per channel, K = 200 and 1028 (the last
    # tile step past the inputs, read from a padded copy), a block of 7 columns; whole tiles
    [
        (4, 33, 256, 32),
        (21, 40, 136, 64),
        (35, 48, 384, 128),
        (17, 7, 200, "channel"),
        (18, 24, 1028, "channel"),
        (32, 16, 192, 64),
    ],
)
@pytest.mark.parametrize("scheme", ["asymmetric", "symmetric", "asymmetric-rotated"])
def test_int4_products_on_tiles_give_the_references_floats(amx_path, m, n, k, group, scheme):
    g = torch.Generator().manual_seed(m + n + k)
    qw = quantized(torch.randn(n, k, generator=g), scheme, k if group == "channel" else group)
    packed = cpu_kernels.pack_qweight(qw)
    assert on_tiles(amx_path, m, packed)
    x = rows(m, k, seed=k)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))
    # cpu.linear: the main library's blocks (int4w_fn) where it quantizes the rows itself
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.linear(x, packed, bias), quant.linear(x, qw, bias))


@pytest.mark.parametrize("m,n,k", [(6, 33, 96), (37, 64, 256)])
def test_mxfp4_products_on_tiles_give_the_references_floats(amx_path, m, n, k):
    qw = mxfp4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    packed = cpu_kernels.pack_qweight(qw)
    assert on_tiles(amx_path, m, packed)
    x = rows(m, k, seed=m)
    assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))
    assert torch.equal(cpu_kernels.linear(x, packed), quant.linear(x, qw))


@pytest.mark.parametrize("m,group", [(5, 32), (19, 128)])
def test_act_order_products_on_tiles_gather_their_rows_as_the_reference(amx_path, m, group):
    n, k = 40, 256
    act = shuffled(
        asymmetric_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), group),
        seed=k,
    )
    packed = cpu_kernels.pack_qweight(act)
    assert on_tiles(amx_path, m, packed)
    x = rows(m, k, seed=m)
    assert torch.equal(cpu_kernels.linear(x, packed), quant.linear(x, act))


def test_the_fewest_rows_and_small_groups_stay_off_the_tiles(amx_path):
    """One row (decode) and groups of 8 or 16 inputs run on int4.c (the fallback), their
    floats the reference's all the same."""
    qw = asymmetric_int4(torch.randn(24, 128, generator=torch.Generator().manual_seed(1)), 16)
    packed = cpu_kernels.pack_qweight(qw)
    assert not on_tiles(amx_path, 1, packed) and not on_tiles(amx_path, 8, packed)
    for m in (1, 8):
        x = rows(m, 128, seed=m)
        assert torch.equal(cpu_kernels.int4_products(x, packed), quant._int4_products(x, qw))


@pytest.mark.parametrize(
    "scheme,group",
    [("asymmetric", 32), ("symmetric", 128), ("asymmetric", "channel"), ("mxfp4", 32)],
)
def test_moe_on_tiles_gives_the_int4_paths_bits(amx_path, scheme, group):
    """The MoE kernel on 4-bit experts with 40 tokens (10-30 rows an expert, gate and up blocks
    in pairs): the same bf16 outputs as with the tiles off (int4.c's products)."""
    t, d, i, e = 40, 256, 96, 4
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(e, 2 * i, d, generator=g) * 0.1, torch.randn(e, d, i, generator=g) * 0.1
    q13 = quantized(w13, scheme, d if group == "channel" else group)
    q2 = quantized(w2, scheme, i if group == "channel" else group)
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), 2, True)
    p13, p2 = cpu_kernels.pack_qweight(q13), cpu_kernels.pack_qweight(q2)
    tiles, counts = cpu_kernels.moe(x, p13, p2, ids, weights)
    assert int(counts.min()) >= 4  # every expert's products on the tiles
    isa, vnni, emulated, _ = next(p for p in AMX_PATHS if p[3] == amx_path)
    cpu_kernels.enable(isa, amx=False, emulated=emulated, vnni=vnni)  # (the fixture restores)
    assert not cpu_kernels.INT4.startswith("amx")
    assert torch.equal(tiles, cpu_kernels.moe(x, p13, p2, ids, weights)[0])
