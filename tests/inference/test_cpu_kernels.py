"""The engine's bf16 CPU kernels (inference/cpu_kernels.py): single-row GEMV, the one-token
and the decode-batch (AMX) MoE layers against float32 arithmetic, the model's bf16 logits
against transformers with and without them, the compiled path, and the fallback to ATen when
they cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference import LLMEngine, cpu_kernels
from inference.attention import AttentionMetadata, PrefillChunk
from inference.layers import linear
from tests.inference.parity_checks import hf_model, prompts

if not cpu_kernels.enable():
    pytest.skip("bf16 kernels unavailable here (CPU without AVX512-BF16 or no C compiler)",
                allow_module_level=True)


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def bf16_tolerance(exact: torch.Tensor, terms: torch.Tensor) -> dict:
    """One bf16 rounding of the result, plus float32 summation-order error over the terms."""
    return {"rtol": 2 ** -8, "atol": float(terms.abs().sum(-1).max()) * 2 ** -20 + 1e-6}


@pytest.mark.parametrize("n,k", [(32000, 512), (2048, 512), (300, 64), (37, 100), (5, 17), (1, 1)])
def test_gemv_matches_float32_arithmetic(n, k):
    w, x = randn(n, k), randn(k)
    exact = w.float() @ x.float()
    y = cpu_kernels.gemv(w, x)
    assert y.dtype == torch.bfloat16 and y.shape == (n,)
    torch.testing.assert_close(y.float(), exact, **bf16_tolerance(exact, w.float() * x.float()))


def test_gemv_reads_a_strided_vector_and_row_views():
    w, x = randn(64, 96), randn(2, 96)
    torch.testing.assert_close(cpu_kernels.gemv(w[16:48], x[1]), torch.mv(w[16:48], x[1]),
                               rtol=2 ** -7, atol=0.05)
    column = randn(96, 2)[:, 1]  # stride 2: copied before the kernel reads it
    torch.testing.assert_close(cpu_kernels.gemv(w, column), torch.mv(w, column), rtol=2 ** -7, atol=0.05)


def test_linear_takes_the_kernel_for_one_bf16_row_only():
    w, b = randn(300, 64), randn(300)
    x = randn(1, 64)
    assert torch.equal(linear(x, w), cpu_kernels.gemv(w, x[0]).unsqueeze(0))
    assert torch.equal(linear(x, w, b), cpu_kernels.gemv(w, x[0]).unsqueeze(0) + b)
    x3 = randn(3, 64)
    assert torch.equal(linear(x3, w, b), F.linear(x3, w, b))  # several rows: plain GEMM
    xf, wf = x.float(), w.float()
    assert torch.equal(linear(xf, wf), F.linear(xf, wf))  # float32: the reference's kernels
    wt = randn(64, 300).t()  # not row-contiguous: ATen's GEMV
    assert torch.equal(linear(x, wt), torch.mv(wt, x[0]).unsqueeze(0))


def expert_reference(x, w13, w2, ids, weights):
    """The experts in float32, activations rounded to bf16 where the kernel rounds them."""
    out = torch.zeros(w2.shape[1])
    for e, wt in zip(ids.tolist(), weights.tolist()):
        gate, up = (w13[e].float() @ x.float()).bfloat16().float().chunk(2)
        hidden = (F.silu(gate).bfloat16().float() * up).bfloat16().float()
        out += wt * (w2[e].float() @ hidden).bfloat16().float()
    return out


@pytest.mark.parametrize("d,i,ids", [(512, 1024, [5, 2]), (64, 40, [0, 3, 7]), (33, 17, [1])])
def test_moe_token_matches_float32_arithmetic(d, i, ids):
    e = 8
    w13, w2, x = randn(e, 2 * i, d, scale=0.1), randn(e, d, i, scale=0.1), randn(d)
    ids = torch.tensor(ids)
    weights = torch.rand(len(ids), generator=torch.Generator().manual_seed(3))
    out = cpu_kernels.moe_token(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (d,)
    exact = expert_reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=float(exact.abs().max()) * 2 ** -8)


def decode_logits_error(path, kernels: bool) -> float:
    """Mean |logit - transformers' float32 logit| of a bf16 engine over 4 decode steps."""
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16", kv_cache_tokens=256)
    cpu_kernels.ACTIVE = cpu_kernels.AMX = kernels  # the engine enabled them; the 20-token prefill takes AMX
    ref = hf_model(path)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    model, caches, errors = engine.model, engine.kv_caches, []
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(20), 0, None, None, [PrefillChunk(0, 20, 0, None)])
        model(torch.tensor(tokens[:20]), torch.arange(20), meta, caches)
        for pos in range(20, 24):
            meta = AttentionMetadata(torch.tensor([pos]), 1, torch.arange(pos + 1)[None], None, [])
            hidden, _ = model(torch.tensor([tokens[pos]]), torch.tensor([pos]), meta, caches)
            expected = ref(torch.tensor([tokens[: pos + 1]])).logits[0, -1]
            errors.append((model.logits(hidden)[0].float() - expected).abs().mean().item())
    return sum(errors) / len(errors)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2"])
def test_bf16_decode_with_kernels_is_as_close_to_transformers_as_aten(model_dirs, arch):
    try:
        with_kernels = decode_logits_error(model_dirs(arch), kernels=True)
        with_aten = decode_logits_error(model_dirs(arch), kernels=False)
    finally:
        cpu_kernels.enable()
    assert with_kernels < 0.02
    assert with_kernels <= 1.25 * with_aten, (with_kernels, with_aten)


def test_compiled_linear_calls_the_kernel_without_a_graph_break():
    w, x = randn(300, 64), randn(1, 64)
    explanation = torch._dynamo.explain(linear)(x, w)
    assert explanation.graph_break_count == 0
    ops = [n.target for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.moeserve.bf16_gemv.default in ops or torch.ops.moeserve.bf16_gemv in ops
    compiled = torch.compile(linear, dynamic=True)
    assert torch.equal(compiled(x, w), cpu_kernels.gemv(w, x[0]).unsqueeze(0))


def test_kernels_off_by_environment_and_when_the_build_fails(monkeypatch, tmp_path):
    try:
        monkeypatch.setenv("MOESERVE_BF16_KERNELS", "0")
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.enable() is False and cpu_kernels.ACTIVE is False
        w, x = randn(300, 64), randn(1, 64)
        assert torch.equal(linear(x, w), torch.mv(w, x[0]).unsqueeze(0))

        monkeypatch.setenv("MOESERVE_BF16_KERNELS", "1")
        monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.enable() is False
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left

        monkeypatch.delenv("CC")
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.enable() is True  # built into the fresh cache folder
        assert len(list((tmp_path / "kernels").glob("bf16_gemv-*.so"))) == 1
    finally:
        monkeypatch.undo()
        cpu_kernels._library.cache_clear()
        cpu_kernels.enable()


def test_moe_layer_takes_the_fused_kernel_for_one_token_eager_and_compiled():
    from inference.moe import MoE, single_token_dispatch

    moe = MoE(64, 40, num_experts=8, top_k=2, norm_topk_prob=True)
    for p, shape in ((moe.gate, (8, 64)), (moe.w13, (8, 80, 64)), (moe.w2, (8, 64, 40))):
        p.data = randn(*shape, scale=0.2)
    x = randn(1, 64)
    with torch.inference_mode():
        out, counts = moe(x)
        weights, ids = moe.route(x)
        aten = single_token_dispatch(x, weights, ids, moe.w13, moe.w2)
        torch.testing.assert_close(out, aten, rtol=2 ** -7, atol=float(aten.abs().max()) * 2 ** -7)
        assert counts.tolist() == [int(e in ids[0].tolist()) for e in range(8)]
        explanation = torch._dynamo.explain(moe)(x)
        assert explanation.graph_break_count == 0
        ops = {n.target for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"}
        assert ops & {torch.ops.moeserve.bf16_moe_token.default, torch.ops.moeserve.bf16_moe_token}
        compiled_out, compiled_counts = torch.compile(moe, dynamic=True)(x)
        assert torch.equal(compiled_counts, counts)
        torch.testing.assert_close(compiled_out, out, rtol=2 ** -7, atol=float(out.abs().max()) * 2 ** -7)


def needs_amx():
    if not cpu_kernels.AMX:
        pytest.skip("no AMX on this CPU (or the kernel refused AMX state): padded_dispatch keeps bmm")


@pytest.mark.parametrize("t,d,i,top_k", [(32, 512, 1024, 2), (80, 64, 32, 2), (3, 32, 64, 3), (40, 96, 64, 1)])
def test_moe_batch_matches_float32_arithmetic(t, d, i, top_k):
    from inference.moe import select_experts

    needs_amx()
    e = 8
    w13, w2, x = randn(e, 2 * i, d, scale=0.1), randn(e, d, i, scale=0.1), randn(t, d)
    g = torch.Generator().manual_seed(t)
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), top_k, True)
    out = cpu_kernels.moe_batch(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (t, d)
    for row in range(t):
        exact = expert_reference(x[row], w13, w2, ids[row], weights[row])
        torch.testing.assert_close(out[row].float(), exact, rtol=2 ** -7, atol=float(exact.abs().max()) * 2 ** -8)


def test_decode_batches_take_the_amx_kernel_and_match_batched_matmuls():
    from inference.moe import dispatch, padded_dispatch, select_experts

    needs_amx()
    g = torch.Generator().manual_seed(5)
    w13, w2 = randn(8, 128, 64, scale=0.2), randn(8, 64, 64, scale=0.2)
    x = randn(80, 64)
    weights, ids = select_experts(torch.rand(80, 8, generator=g).softmax(-1), 2, True)
    out, counts = dispatch(x, weights, ids, w13, w2, gather_max_tokens=0)
    assert counts.max() > 16  # more than one tile of tokens on the busiest expert
    assert torch.equal(out, cpu_kernels.moe_batch(x, w13, w2, ids, weights))
    bmm = padded_dispatch(x, weights, ids, counts, w13, w2)
    torch.testing.assert_close(out, bmm, rtol=2 ** -7, atol=float(bmm.abs().max()) * 2 ** -7)
