"""The int4 linear kernel (csrc/int4.c, W4A8, issue 40) on each path this CPU runs, forced one
by one as int8's are: AVX512-VNNI's vpdpbusd and AVX2's vpmaddubsw. Each gives the torch
reference's floats exactly (quantization/qweight.py: exact integer sums per group, summed
in the same float32 order); the packed layout holds every value; a served model runs its
linear layers on the kernel."""

from __future__ import annotations

import platform

import pytest
import torch

from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuExperts, CpuLinear
from inference.models.attention import AttentionMetadata, PrefillChunk
from inference.models.moe import grouped_dispatch, select_experts
from inference.quantization import qweight as quant
from tests.inference.parity_checks import prompts
from tests.inference.test_int4 import engine, prompt_logprobs

# (build, vnni switch, emulated, the int4 path enable() must pick): AMX int8 tiles (natively
# where the CPU has them; on amx_emulation.h's plain-C tiles over SIMDe's AVX-VNNI on any AVX2
# CPU), AVX512-VNNI, AVX-VNNI (natively where the CPU has it; on SIMDe's vpdpbusd on any AVX2
# CPU), vpmaddubsw
INT4_PATHS = [
    ("avx512", None, False, "amx"),
    ("avx2", None, True, "amx-emulated"),
    ("avx512bf16", None, False, "vnni"),
    ("avx2", None, False, "avxvnni"),
    ("avx2", None, True, "avxvnni-emulated"),
    ("avx512", False, False, "avx2"),
    ("avx2", False, False, "avx2"),
]
CPU_FLAG = {"amx": "amx_int8", "vnni": "avx512_vnni", "avxvnni": "avx_vnni"}


def path_id(path) -> str:
    return f"{path[0]}-int4={path[3]}"


@pytest.fixture(params=INT4_PATHS, ids=path_id)
def int4_path(request):
    yield from forced_int4_path(request.param)


def forced_int4_path(path):
    """Enables one of INT4_PATHS for a test (skipped where this CPU cannot run it), yields its
    name and restores the automatic choice after."""
    isa, vnni, emulated, expected = path
    if platform.machine() not in ("x86_64", "AMD64") or isa not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    if CPU_FLAG.get(expected, "avx2") not in cpu_kernels.cpu_flags():
        pytest.skip(f"this CPU lacks {CPU_FLAG[expected]}")
    cpu_kernels.enable(isa, amx=expected.startswith("amx"), emulated=emulated, vnni=vnni)
    try:
        if expected == "amx" and not cpu_kernels.AMX:
            pytest.skip("Linux refused the AMX register state")
        assert cpu_kernels.INT4 == expected and cpu_kernels.paths()["int4"] == expected
        yield expected
    finally:
        cpu_kernels.enable()


def weights_and_rows(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + m + n + k)
    return torch.randn(n, k, generator=g), (torch.randn(m, k, generator=g) * 3).bfloat16()


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 40, 576), (5, 300, 256), (9, 33, 130), (3, 16, 1024), (17, 7, 8), (64, 129, 384)],
)
@pytest.mark.parametrize("rotated", [True, False])
def test_int4_linear_gives_the_references_floats(int4_path, m, n, k, rotated):
    w, x = weights_and_rows(m, n, k)
    qw = quant.quantize_int4(w, rotated=rotated)
    packed = cpu_kernels.pack_qweight(qw)
    assert packed.packed and packed.data.numel() == -(-k // 8) * 4 * n  # two values a byte
    reference = quant._int4_products(x, qw)
    assert torch.equal(cpu_kernels.int4_products(x, packed), reference)  # int4.c's own linear
    # cpu.linear: ms_linear (rotated, K % 8 == 0: activations rotated and quantized in C) or
    # int4.c's own linear, both the reference's bf16 outputs exactly
    bias = torch.randn(n).bfloat16()
    assert torch.equal(cpu_kernels.linear(x, packed, bias), quant.linear(x, qw, bias))


def test_int4_sums_at_the_extremes_are_exact(int4_path):
    """Every value at its largest magnitude (weights -8, activations +-127) over many groups:
    no int16 pair saturates in vpmaddubsw, no offset error."""
    k, n = 2048, 48
    qw = quant.QWeight(
        "int4",
        torch.full((n, k), -8, dtype=torch.int8),
        torch.ones(k // 128, n),
        128,
        k,
        rotated=False,
    )
    qw.data[::2, 1::3] = 7
    x = torch.full((3, k), 127.0).bfloat16()
    x[1] = -127.0
    x[2, ::5] = -127.0
    reference = quant._int4_products(x, qw)
    assert torch.equal(cpu_kernels.int4_products(x, cpu_kernels.pack_qweight(qw)), reference)


def test_a_model_serves_its_int4_linear_layers_on_the_kernel(int4_path, model_dirs):
    path = model_dirs("qwen2_moe")
    eng = engine(path, quantization="int4")
    model = eng.executor.model
    wo = model.layers[0].attn.wo  # (q/k/v stay int8: Int4Choices.wide)
    assert isinstance(wo, CpuLinear) and wo.weight.fmt == "int4" and wo.weight.packed
    n, k = wo.weight.out_features, wo.weight.in_features
    groups = n * -(-k // 128)  # 4 bits a weight, a float32 scale (and an int8 zero) per 128
    zeros = 0 if wo.weight.zero is None else groups
    assert wo.weight.nbytes == n * k // 2 + 4 * groups + zeros
    assert isinstance(model.layers[0].mlp.moe.experts, CpuExperts)  # the MoE kernel
    assert eng.executor.fused_step is not None  # the one-call decode step too
    batch = prompts(eng.args.vocab_size, [30])
    ours = prompt_logprobs(eng, batch)
    cpu_kernels.enable(None)  # the same engine on torch's path throughout (the fixture restores)
    torch_path = prompt_logprobs(engine(path, quantization="int4"), batch)
    # the kernels' bf16 attention and norms differ from ATen's by bf16 roundings only
    assert (ours - torch_path).abs().mean().item() < 0.02


@pytest.mark.parametrize(
    "t,d,i,e,top_k",
    # D = 136: 17 octets in two groups (a partial last group); I = 40: a narrow column block
    [(1, 64, 128, 8, 2), (7, 136, 40, 4, 2), (40, 256, 64, 8, 2), (150, 128, 64, 4, 2)],
)
def test_moe_on_int4_experts_matches_the_torch_path(int4_path, t, d, i, e, top_k):
    g = torch.Generator().manual_seed(t)
    w13, w2 = torch.randn(e, 2 * i, d, generator=g) * 0.1, torch.randn(e, d, i, generator=g) * 0.1
    x = torch.randn(t, d, generator=g).bfloat16()
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), top_k, True)
    q13, q2 = quant.quantize_int4(w13), quant.quantize_int4(w2)
    assert cpu_kernels.int4_moe_fits(q13, d)
    out, counts = cpu_kernels.moe(
        x, cpu_kernels.pack_qweight(q13), cpu_kernels.pack_qweight(q2), ids, weights
    )
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=e).tolist()
    # the torch path rounds the SwiGLU's inputs and the weighted sum in bf16: a rounding or
    # two apart (the products themselves are the reference's, test above)
    ref = grouped_dispatch(x, weights, ids, counts, q13, q2, quant.linear).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=float(ref.abs().max()) * 2**-6)


def test_int4_experts_the_moe_kernel_cannot_take_are_refused(int4_path):
    q13 = quant.quantize_int4(torch.randn(2, 12, 20))  # D = 20: not a multiple of 8
    assert not cpu_kernels.int4_moe_fits(q13, 20)
    q13 = quant.quantize_int4(torch.randn(2, 20, 64))  # I = 10: not a multiple of 8
    assert not cpu_kernels.int4_moe_fits(q13, 64)
    # unrotated experts (published checkpoints) fit: their rows are quantized unrotated
    unrotated = quant.quantize_int4(torch.randn(2, 16, 64), rotated=False)
    assert cpu_kernels.int4_moe_fits(unrotated, 64)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_the_one_call_decode_step_on_int4_computes_what_the_composed_layers_do(
    int4_path, model_dirs, arch
):
    """A decode step of three sequences (contexts of 5, 20 and 37 tokens in scattered cache
    blocks) in one kernel call and through the layers composed op by op, on int4 weights."""
    fused_step_equals_the_composed_layers(engine(model_dirs(arch), quantization="int4"))


def fused_step_equals_the_composed_layers(eng) -> None:
    """One decode step of three sequences (contexts of 5, 20 and 37 tokens in scattered cache
    blocks) in one kernel call and through the layers composed op by op: the same expert
    counts, the same hidden rows but for bf16 roundings, the same greedy tokens."""
    model, caches = eng.executor.model, eng.executor.kv_caches
    fused = eng.executor.fused_step
    assert fused is not None
    lengths, tables = [5, 20, 37], [[7, 1, 30], [2, 9, 4], [12, 3, 25]]
    seqs = prompts(eng.args.vocab_size, [n + 1 for n in lengths])
    with torch.inference_mode():
        for seq, table, n in zip(seqs, tables, lengths):  # prefill each context into its blocks
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
            chunk = [PrefillChunk(0, n, 0, None)]
            meta = AttentionMetadata(slots, 0, None, None, chunk)
            model(torch.tensor(seq[:n]), torch.arange(n), meta, caches)
        meta = AttentionMetadata(
            torch.tensor([t[n // 16] * 16 + n % 16 for t, n in zip(tables, lengths)]),
            3,
            None,
            None,
            [],
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(lengths, dtype=torch.int32) + 1,
            block_size=16,
        )
        ids = torch.tensor([s[n] for s, n in zip(seqs, lengths)])
        step = (ids, torch.tensor(lengths), meta, caches)
        one_call, counts = fused(*step)
        composed, composed_counts = model(*step)
    assert torch.equal(counts, composed_counts)
    torch.testing.assert_close(one_call.float(), composed.float(), rtol=2**-6, atol=2**-6)
    assert torch.equal(model.logits(one_call).argmax(-1), model.logits(composed).argmax(-1))


def test_unrotated_int4_runs_the_fused_step_on_unrotated_rows(int4_path, model_dirs, monkeypatch):
    """MOESERVE_INT4_ROTATE=0: the kernels quantize the activation rows unrotated (wmat's
    `plain`), the fused step included."""
    monkeypatch.setenv("MOESERVE_INT4_ROTATE", "0")
    eng = engine(model_dirs("mixtral"), quantization="int4")
    layer = eng.executor.model.layers[0]
    assert isinstance(layer.attn.wo, CpuLinear) and not layer.attn.wo.weight.rotated
    assert isinstance(layer.mlp.experts, CpuExperts)
    fused_step_equals_the_composed_layers(eng)
