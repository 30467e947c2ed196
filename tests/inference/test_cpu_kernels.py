"""The engine's bf16 CPU kernels (inference/kernels/cpu.py, csrc/): every path this CPU can
run, top level first and then each fallback forced, against float32 arithmetic; the model's
bf16 logits against transformers on each path; the compiled path; the choice of instruction
set by the CPU's flags (never an instruction the CPU lacks).

Paths a CPU cannot run natively are still checked where they can be: the AVX-512 source
built on SIMDe's portable intrinsics, and the AMX source on amx_emulation.h's plain-C tile
instructions. A native path the CPU lacks is skipped with the reason.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from inference import LLMEngine, SamplingParams
from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuLinear
from inference.models.attention import AttentionMetadata, PrefillChunk
from inference.models.moe import select_experts
from tests.inference.kernel_paths import PATHS, Path, forced
from tests.inference.parity_checks import hf_model, prompts


@pytest.fixture(params=PATHS, ids=str)
def path(request):
    with forced(request.param) as p:
        yield p


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def close_to_bf16(out: torch.Tensor, exact: torch.Tensor, rounds: int = 1) -> None:
    """out (bf16) is exact (float32) up to `rounds` bf16 roundings of intermediate values."""
    scale = float(exact.abs().max()) + 1e-6
    torch.testing.assert_close(out.float(), exact, rtol=rounds * 2**-8, atol=rounds * scale * 2**-9)


def close_to_int4_attention(out: torch.Tensor, exact: torch.Tensor) -> None:
    """Decode attention over int4 cache rows against float32 attention over the values the
    rows stand for. The kernel rounds more than bf16 does, as llama.cpp's Q4 x Q8 products do:
    the query to int8 per 32 values and the softmax weights (times the rows' scales) to 8 bits
    per chunk of 32 positions, within 1/32 of the output's largest value; test_kv_int4 checks
    that this stays a small share of the int4 rows' own error."""
    scale = float(exact.abs().max()) + 1e-6
    torch.testing.assert_close(out.float(), exact, rtol=2**-5, atol=scale * 2**-5)


# ---- choosing the instruction set ------------------------------------------------------


def test_only_builds_the_cpu_reports_are_runnable(monkeypatch):
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: avx2_only)
    assert cpu_kernels.runnable_isas() == ["avx2"]
    avx512 = avx2_only | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: avx512)
    assert cpu_kernels.runnable_isas() == ["avx512", "avx2"]
    zen4 = avx512 | {"avx512_bf16", "avx512_vnni"}  # the avx512bf16 build takes both
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: zen4)
    assert cpu_kernels.runnable_isas() == ["avx512bf16", "avx512", "avx2"]
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: avx512 | {"avx512_bf16"})
    assert cpu_kernels.runnable_isas() == ["avx512", "avx2"]
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: zen4 | {"amx_tile", "amx_bf16"})
    assert cpu_kernels.runnable_isas() == [
        "avx512",
        "avx512bf16",
        "avx2",
    ]  # a Xeon: AMX beside FMA tiles
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert cpu_kernels.runnable_isas() == []
    try:
        assert cpu_kernels.enable() is None  # neither AVX2 nor AVX-512: ATen's kernels
        assert cpu_kernels.paths()["linear"] == "aten"
        with pytest.raises(RuntimeError, match="cannot run the avx2 kernels"):
            cpu_kernels.enable("avx2")  # never forced onto a CPU that lacks it
    finally:
        monkeypatch.undo()
        cpu_kernels.enable()


def test_other_machines_run_atens_kernels(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_kernels.runnable_isas() == []


def test_forcing_an_instruction_set_this_cpu_lacks_raises_instead_of_crashing():
    lacking = [isa for isa in cpu_kernels.PREFERENCE if isa not in cpu_kernels.runnable_isas()]
    if not lacking:
        pytest.skip("this CPU runs every build")
    try:
        with pytest.raises(RuntimeError, match="cannot run"):
            cpu_kernels.enable(lacking[0])
    finally:
        cpu_kernels.enable()


def test_amx_off_by_environment_keeps_the_avx512_kernels(monkeypatch):
    if Path("avx512", amx=True).missing():
        pytest.skip(f"avx512+amx: {Path('avx512', amx=True).missing()}")
    monkeypatch.delenv("MOESERVE_BF16_KERNELS", raising=False)  # this test's own switch only
    monkeypatch.setenv("MOESERVE_AMX", "0")
    try:
        assert cpu_kernels.enable() == "avx512" and not cpu_kernels.AMX
        assert cpu_kernels.paths()["moe_batch"] == "avx512"
    finally:
        monkeypatch.undo()
        cpu_kernels.enable()


_AMX_REFUSED = 77  # the script's exit status where Linux refuses the AMX register state
# oneDNN's AMX matmul between two kernel calls: it configures the tiles of the threads the
# kernels' tiles run on, then releases them. Rows 20 and 7: a tail of 4, then of 7.
_TILES_SHARED_WITH_ONEDNN = f"""
import sys
import torch
from inference.kernels import cpu as cpu_kernels
from inference.quantization import qweight as quant
assert cpu_kernels.enable("avx512", amx=True) == "avx512"
if not cpu_kernels.AMX:
    sys.exit({_AMX_REFUSED})
assert cpu_kernels.INT8 == "amx"
g = torch.Generator().manual_seed(0)
w = torch.randn(96, 256, generator=g).bfloat16()
weights = [cpu_kernels.pack_weight(w), cpu_kernels.pack_qweight(quant.quantize_int8(w.float()))]
rows = [torch.randn(m, 256, generator=g).bfloat16() for m in (20, 7)]
want = [[cpu_kernels.linear(x, p) for p in weights] for x in rows]
big = torch.randn(512, 1024, generator=g).bfloat16()
for _ in range(3):
    for x, expected in zip(rows, want):
        for p, out in zip(weights, expected):
            big @ big.t()
            assert torch.equal(cpu_kernels.linear(x, p), out)
"""


def test_amx_tiles_are_configured_again_after_onednn_used_them():
    """The kernels keep a thread's tile configuration for the rest of a call (amx.c); a call
    that follows oneDNN's matmul on the same threads must configure them again, or its first
    tile instruction is illegal (SIGILL): run in a process of its own so that shows as a
    failure."""
    amx = Path("avx512", amx=True)
    lacking = amx.missing() or (
        None if "amx_int8" in cpu_kernels.cpu_flags() else "this CPU lacks amx_int8"
    )
    if lacking:
        pytest.skip(f"avx512+amx: {lacking}")
    run = subprocess.run(
        [sys.executable, "-c", _TILES_SHARED_WITH_ONEDNN],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode == _AMX_REFUSED:
        pytest.skip("avx512+amx: Linux refused the AMX register state")
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"


def test_a_failed_build_falls_back_to_the_next_instruction_set(monkeypatch):
    if "avx2" not in cpu_kernels.runnable_isas():
        pytest.skip("this CPU has no AVX2")
    real = cpu_kernels.load_build

    def old_compiler(isa, emulated=False):
        if isa != "avx2":
            raise RuntimeError(f"cc: error: unrecognized command-line option for {isa}")
        return real(isa, emulated)

    monkeypatch.delenv("MOESERVE_BF16_KERNELS", raising=False)  # the automatic choice is tested
    monkeypatch.setattr(cpu_kernels, "runnable_isas", lambda: ["avx512bf16", "avx512", "avx2"])
    monkeypatch.setattr(cpu_kernels, "load_build", old_compiler)
    try:
        assert cpu_kernels.enable() == "avx2"
    finally:
        monkeypatch.undo()
        cpu_kernels.enable()


def test_kernels_off_by_environment_and_when_the_build_fails(monkeypatch, tmp_path):
    if not cpu_kernels.runnable_isas():
        pytest.skip("no kernel build runs on this CPU")
    try:
        monkeypatch.setenv("MOESERVE_BF16_KERNELS", "0")
        assert cpu_kernels.enable() is None and cpu_kernels.ISA is None
        monkeypatch.setenv("MOESERVE_BF16_KERNELS", "1")
        monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        cpu_kernels.load_build.cache_clear()
        assert cpu_kernels.enable() is None
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left
        monkeypatch.delenv("CC")
        cpu_kernels.load_build.cache_clear()
        assert cpu_kernels.enable() == cpu_kernels.runnable_isas()[0]  # built into the fresh folder
        assert len(list((tmp_path / "kernels").glob("kernels-*.so"))) == 1
    finally:
        monkeypatch.undo()
        cpu_kernels.load_build.cache_clear()
        cpu_kernels.enable()


def test_the_kernel_cache_builds_anew_when_a_common_flag_changes(monkeypatch, tmp_path):
    """The cache key holds every flag: a library built with other common flags (a -g build,
    a changed -O level) is never taken for this one."""
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    source, flags = [cpu_kernels._CSRC / "hadamard.c"], cpu_kernels.BUILDS["avx2"][0]
    first = cpu_kernels._build(source, flags, "probe")
    monkeypatch.setattr(cpu_kernels, "_COMMON_FLAGS", [*cpu_kernels._COMMON_FLAGS, "-g"])
    second = cpu_kernels._build(source, flags, "probe")
    assert second != first and first.exists() and second.exists()
    monkeypatch.undo()
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    assert cpu_kernels._build(source, flags, "probe") == first  # found, not built again


# ---- packing ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(32, 64), (37, 17), (1, 2), (16, 1), (3, 40, 33), (2, 160, 64)])
def test_pack_weight_round_trips(shape):
    w = randn(*shape)
    packed = cpu_kernels.pack_weight(w)
    k = shape[-1]
    assert packed.shape == (*shape[:-2], (k + 1) // 2, shape[-2], 2)
    assert cpu_kernels.is_packed(packed, matrix_dims=len(shape))
    assert torch.equal(cpu_kernels.unpack_weight(packed, k), w)


# ---- the kernels against float32 arithmetic, on every path -----------------------------


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 32000, 512),
        (1, 300, 64),
        (5, 17, 1),
        (37, 100, 33),
        (40, 64, 64),
        (300, 48, 96),
        (2, 1, 512),
    ],
)
def test_linear_matches_float32_arithmetic(path, m, n, k):
    w, x, b = randn(n, k), randn(m, k, seed=1), randn(n, seed=2)
    packed = cpu_kernels.pack_weight(w)
    exact = x.float() @ w.float().t()
    close_to_bf16(cpu_kernels.linear(x, packed), exact)
    close_to_bf16(cpu_kernels.linear(x, packed, b), exact + b.float())
    module = CpuLinear(w, b)  # the module the CPU backend installs for a Linear
    assert torch.equal(module(x), cpu_kernels.linear(x, packed, b))


def test_linear_reads_strided_rows_and_per_head_weights(path):
    x = randn(6, 3, 64)
    w = randn(3, 48, 64, seed=4)
    exact = torch.einsum("bhk,hnk->bhn", x.float(), w.float())
    close_to_bf16(cpu_kernels.linear_heads(x, cpu_kernels.pack_weight(w)), exact)
    rows = x[:, 1]  # a row stride of 192 elements
    close_to_bf16(cpu_kernels.linear(rows, cpu_kernels.pack_weight(w[1])), exact[:, 1])


def expert_reference(x, w13, w2, ids, weights):
    """The experts in float32, activations rounded to bf16 where the kernel rounds them."""
    out = torch.zeros(w2.shape[1])
    for e, wt in zip(ids.tolist(), weights.tolist()):
        gate, up = (w13[e].float() @ x.float()).bfloat16().float().chunk(2)
        hidden = (F.silu(gate).bfloat16().float() * up).bfloat16().float()
        out += wt * (w2[e].float() @ hidden).bfloat16().float()
    return out


@pytest.mark.parametrize(
    "t,d,i,e,top_k",
    [
        (1, 512, 1024, 8, 2),
        (1, 33, 17, 8, 3),
        (3, 32, 64, 8, 3),
        (32, 64, 64, 8, 2),
        (80, 64, 32, 8, 2),
        (40, 96, 64, 16, 1),
        (300, 64, 64, 4, 2),
    ],
)
def test_moe_matches_float32_arithmetic(path, t, d, i, e, top_k):
    w13, w2, x = (
        randn(e, 2 * i, d, scale=0.1),
        randn(e, d, i, scale=0.1, seed=1),
        randn(t, d, seed=2),
    )
    g = torch.Generator().manual_seed(t)
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), top_k, True)
    out, counts = cpu_kernels.moe(
        x, cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2), ids, weights
    )
    assert out.dtype == torch.bfloat16 and out.shape == (t, d)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=e).tolist()
    for row in range(t):
        exact = expert_reference(x[row], w13, w2, ids[row], weights[row])
        torch.testing.assert_close(
            out[row].float(), exact, rtol=2**-7, atol=float(exact.abs().max()) * 2**-8
        )


def test_moe_rejects_an_expert_id_out_of_range(path):
    w13, w2, x = randn(4, 64, 32), randn(4, 32, 32), randn(2, 32)
    ids = torch.tensor([[0, 1], [2, 4]])
    with pytest.raises(ValueError, match="invalid input"):
        cpu_kernels.moe(
            x, cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2), ids, torch.ones(2, 2)
        )


def paged_cache(num_blocks, block_size, heads, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks * block_size, heads, width, generator=g)).bfloat16()


def attention_reference(q, k_cache, v_cache, table, length, block_size, scale, v_dim=None):
    pos = torch.arange(length)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    h, g = q.shape[0], k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(h // g, 1).transpose(0, 1)
    v = v_cache[slots].float()[..., :v_dim].repeat_interleave(h // g, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.float().unsqueeze(1), k, v, scale=scale).squeeze(1)


@pytest.mark.parametrize(
    "batch,heads,kv_heads,dim,lengths",
    [
        (3, 8, 2, 64, [5, 40, 170]),  # grouped-query heads, several blocks each
        (1, 4, 4, 32, [1]),  # one token of context
        (1, 8, 2, 64, [1000]),  # one long sequence: split over the threads (flash-decoding)
        (2, 6, 2, 20, [17, 33]),  # a head width that is no multiple of the vector width
    ],
)
def test_decode_attention_reads_the_paged_cache_in_place(
    path, batch, heads, kv_heads, dim, lengths
):
    bs, nblocks = 16, 80
    kc, vc = (
        paged_cache(nblocks, bs, kv_heads, dim),
        paged_cache(nblocks, bs, kv_heads, dim, seed=1),
    )
    g = torch.Generator().manual_seed(2)
    width = max(lengths) // bs + 1
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:width] for _ in range(batch)]).int()
    q = randn(batch, heads, dim, seed=3)
    out = cpu_kernels.decode_attention(
        q, kc, vc, tables, torch.tensor(lengths, dtype=torch.int32), bs, 0.125
    )
    for b, n in enumerate(lengths):
        close_to_bf16(out[b], attention_reference(q[b], kc, vc, tables[b], n, bs, 0.125))


def test_decode_attention_over_one_latent_cache_as_mla_reads_it(path):
    bs, r, p = 16, 64, 16
    cache = paged_cache(20, bs, 1, r + p)
    tables = torch.arange(20, dtype=torch.int32).flip(0).view(2, 10)
    q = randn(2, 16, r + p, seed=5)
    lengths = torch.tensor([150, 9], dtype=torch.int32)
    out = cpu_kernels.decode_attention(q, cache, cache, tables, lengths, bs, 0.1, v_dim=r)
    assert out.shape == (2, 16, r)
    for b in range(2):
        close_to_bf16(
            out[b],
            attention_reference(q[b], cache, cache, tables[b], int(lengths[b]), bs, 0.1, v_dim=r),
        )


def test_rms_norm_and_residual_add_round_as_the_reference(path):
    x, residual, w = randn(5, 96), randn(5, 96, seed=1), randn(96, seed=2)
    ref_sum = x + residual
    ref = F.rms_norm(ref_sum.float(), (96,), eps=1e-5).to(torch.bfloat16) * w
    res = residual.clone()
    out = cpu_kernels.rms_norm(x, w, 1e-5, res)
    assert torch.equal(res, ref_sum)  # the residual add, in place
    torch.testing.assert_close(
        out, ref, rtol=2**-7, atol=0
    )  # rsqrt vs 1/sqrt: at most one bf16 step
    plain = F.rms_norm(x.float(), (96,), eps=1e-5).to(torch.bfloat16) * w
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), plain, rtol=2**-7, atol=0)


@pytest.mark.parametrize("rows, vocab", [(32, 32000), (3, 17), (2, 257), (1, 151936)])
def test_greedy_picks_what_torch_max_picks(path, rows, vocab):
    logits = randn(rows, vocab, seed=rows)
    assert cpu_kernels.greedy(logits) == logits.max(dim=-1).indices.tolist()
    strided = randn(rows, vocab + 5, seed=3)[:, :vocab]  # rows of a wider tensor
    assert cpu_kernels.greedy(strided) == strided.max(dim=-1).indices.tolist()


def test_greedy_ties_go_to_the_first_index(path):
    logits = torch.zeros(3, 1000, dtype=torch.bfloat16)
    logits[0, [700, 300, 900]] = 1.0  # tied maxima in different stretches
    logits[1] = -float("inf")  # a fully masked row (a grammar allowing nothing)
    logits[2, [5, 6]] = 2.0  # tied neighbours
    assert cpu_kernels.greedy(logits) == [300, 0, 5] == logits.max(dim=-1).indices.tolist()


def test_rope_and_cache_write_match_the_reference_ops_bit_for_bit(path):
    from inference.models.layers import apply_rope

    t, h, g, d = 7, 4, 2, 64
    qkv = randn(t, h + 2 * g, d)
    cos, sin = randn(t, 1, d, seed=1), randn(t, 1, d, seed=2)
    slots = torch.tensor([9, 3, 0, 12, 5, 7, 1])
    kc, vc = (
        torch.zeros(16, g, d, dtype=torch.bfloat16),
        torch.zeros(16, g, d, dtype=torch.bfloat16),
    )
    expected = apply_rope(qkv[:, : h + g], cos, sin)
    ours = qkv.clone()
    cpu_kernels.rope_and_cache(ours, cos, sin, h, g, slots, kc, vc)
    assert torch.equal(ours[:, : h + g], expected)
    assert torch.equal(ours[:, h + g :], qkv[:, h + g :])
    assert torch.equal(kc[slots], expected[:, h:]) and torch.equal(vc[slots], qkv[:, h + g :])


@pytest.mark.parametrize("rotary", [32, 16, 6])
def test_partial_rotary_rotates_the_first_dims_of_each_head_as_torch_does(path, rotary):
    """GLM-4.5's and MiniMax-M2's partial rotary: tables of `rotary` < d columns rotate each
    head's first `rotary` dims (rotate-half within them; 6: shorter than a vector) and leave
    the rest as they were, bit for bit as the torch path and transformers compute."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    from inference.models.layers import apply_rope

    t, h, g, d = 19, 4, 2, 64  # 19 rows: the threaded loop too
    qkv = randn(t, h + 2 * g, d, seed=rotary)
    cos, sin = randn(t, 1, rotary, seed=1), randn(t, 1, rotary, seed=2)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:t]
    kc, vc = (torch.zeros(32, g, d, dtype=torch.bfloat16) for _ in range(2))
    expected = apply_rope(qkv[:, : h + g], cos, sin)
    # transformers' own (heads before tokens): q and k alike
    heads_first = qkv[:, : h + g].transpose(0, 1)[None]
    reference, _ = apply_rotary_pos_emb(heads_first, heads_first, cos[:, 0][None], sin[:, 0][None])
    assert torch.equal(expected, reference[0].transpose(0, 1))
    assert torch.equal(expected[..., rotary:], qkv[:, : h + g, rotary:])  # the rest passes
    ours = qkv.clone()
    cpu_kernels.rope_and_cache(ours, cos, sin, h, g, slots, kc, vc)
    assert torch.equal(ours[:, : h + g], expected)
    assert torch.equal(ours[:, h + g :], qkv[:, h + g :])
    assert torch.equal(kc[slots], expected[:, h:]) and torch.equal(vc[slots], qkv[:, h + g :])
    with pytest.raises(ValueError, match="width"):
        cpu_kernels.rope_and_cache(
            ours, randn(t, 1, d + 2), randn(t, 1, d + 2), h, g, slots, kc, vc
        )


# ---- the model on each path, against transformers --------------------------------------


def decode_logits_error(path_dir) -> float:
    """Mean |logit - transformers' float32 logit| of a bf16 engine over a 20-token prompt
    and 4 decode steps that read the paged cache the way the runner's steps do."""
    engine = LLMEngine.from_pretrained(
        path_dir, device="cpu", dtype="bfloat16", kv_cache_tokens=256
    )
    ref = hf_model(path_dir)
    tokens = prompts(engine.args.vocab_size, [24])[0]
    model, caches, errors = engine.executor.model, engine.executor.kv_caches, []
    kernel = engine.runner.paged_kernel
    forward = engine.runner.decode_model  # decode steps: the backend's fused step if any
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(20), 0, None, None, [PrefillChunk(0, 20, 0, None)])
        model(torch.tensor(tokens[:20]), torch.arange(20), meta, caches)
        for pos in range(20, 24):
            if kernel:
                meta = AttentionMetadata(
                    torch.tensor([pos]),
                    1,
                    None,
                    None,
                    [],
                    block_tables=torch.arange(16, dtype=torch.int32)[None],
                    context_lens=torch.tensor([pos + 1], dtype=torch.int32),
                    block_size=16,
                )
            else:
                meta = AttentionMetadata(
                    torch.tensor([pos]), 1, torch.arange(pos + 1)[None], None, []
                )
            hidden, _ = forward(torch.tensor([tokens[pos]]), torch.tensor([pos]), meta, caches)
            expected = ref(torch.tensor([tokens[: pos + 1]])).logits[0, -1]
            errors.append((model.logits(hidden)[0].float() - expected).abs().mean().item())
    return sum(errors) / len(errors)


@pytest.fixture(scope="module")
def arch_dirs(model_dirs, tmp_path_factory):
    """arch -> checkpoint folder: the demo MoE models, and a dense Llama with tied embeddings,
    biases everywhere and one KV head (SmolLM2's shape of model)."""
    from tests.inference.test_llama import CONFIGS, TOKENIZER_FILES
    from tests.inference.tiny_gguf import random_llama

    def get(arch: str):
        if arch != "llama":
            return model_dirs(arch)
        path = tmp_path_factory.getbasetemp() / "kernels-llama"
        if not path.exists():
            random_llama(
                model_dirs("mixtral"), seed=1, **CONFIGS["llama_tied_llama3_bias"]
            ).save_pretrained(path)
            for f in TOKENIZER_FILES:
                shutil.copy(model_dirs("mixtral") / f, path / f)
        return path

    return get


ARCHS = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
    "llama",
]
# the families whose layers the one-call decode step does not cover: they would keep the
# composed layers, on the kernels (every family's layers are covered today)
COMPOSED: set[str] = set()
ATEN_ERRORS: dict[str, float] = {}


def aten_error(arch_dirs, arch) -> float:
    if arch not in ATEN_ERRORS:
        try:
            cpu_kernels.enable(None)
            ATEN_ERRORS[arch] = decode_logits_error(arch_dirs(arch))
        finally:
            cpu_kernels.enable()
    return ATEN_ERRORS[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_on_each_path_are_as_close_to_transformers_as_atens(arch_dirs, path, arch):
    ours = decode_logits_error(arch_dirs(arch))
    aten = aten_error(arch_dirs, arch)
    assert ours < 0.02
    assert ours <= 1.25 * aten, (ours, aten)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_one_call_decode_step_computes_what_the_composed_layers_do(arch_dirs, path, arch):
    """A decode step of three sequences (contexts of 5, 20 and 37 tokens in scattered cache
    blocks) in one kernel call and through the layers composed op by op."""
    engine = LLMEngine.from_pretrained(
        arch_dirs(arch), device="cpu", dtype="bfloat16", kv_cache_tokens=512
    )
    model, caches = engine.executor.model, engine.executor.kv_caches
    fused = engine.executor.fused_step
    assert (fused is None) == (arch in COMPOSED)
    one_call_step = fused or model
    lengths, tables = [5, 20, 37], [[7, 1, 30], [2, 9, 4], [12, 3, 25]]
    seqs = prompts(engine.args.vocab_size, [n + 1 for n in lengths])
    with torch.inference_mode():
        for seq, table, n in zip(seqs, tables, lengths):  # prefill each context into its blocks
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
            model(
                torch.tensor(seq[:n]),
                torch.arange(n),
                AttentionMetadata(slots, 0, None, None, [PrefillChunk(0, n, 0, None)]),
                caches,
            )
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
        step = (
            torch.tensor([s[n] for s, n in zip(seqs, lengths)]),
            torch.tensor(lengths),
            meta,
            caches,
        )
        one_call, counts = one_call_step(*step)
        composed, composed_counts = model(*step)
    assert torch.equal(counts, composed_counts)
    torch.testing.assert_close(one_call.float(), composed.float(), rtol=2**-6, atol=2**-6)
    assert torch.equal(model.logits(one_call).argmax(-1), model.logits(composed).argmax(-1))


def test_continuous_batch_on_the_kernels_picks_what_transformers_ranks_top(model_dirs, path):
    """Chunked prefill, preemption (a cache far too small) and prefix-cache hits (a shared
    prefix) on the kernel path: every request finishes, every block comes back, and each
    greedy token is one transformers (float32, over the same prefix) ranks within bf16
    noise of its top logit."""
    mdir = model_dirs("mixtral")
    engine = LLMEngine.from_pretrained(
        mdir,
        device="cpu",
        dtype="bfloat16",
        kv_cache_tokens=192,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    assert engine.runner.paged_kernel
    shared = prompts(engine.args.vocab_size, [32])[0]
    batch = [shared + p for p in prompts(engine.args.vocab_size, [5, 20, 9])] + prompts(
        engine.args.vocab_size, [61, 17]
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    final, preempted, cached = {}, 0, 0
    while engine.has_unfinished:
        outputs, stats = engine.step()
        preempted += stats.num_preemptions
        final.update({o.request_id: o for o in outputs if o.finished})
    cached = sum(o.num_cached_tokens for o in final.values())
    assert preempted > 0 and cached > 0
    assert engine.block_manager.num_used == 0
    ref = hf_model(mdir)
    with torch.inference_mode():
        for i, prompt in enumerate(batch):
            out = final[f"r{i}"].token_ids
            assert len(out) == 12
            logits = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
            assert (logits.max(dim=-1).values - chosen).max() < 0.1, i


def test_the_engine_logs_the_path_of_each_layer_kind(model_dirs, path):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        LLMEngine.from_pretrained(
            model_dirs("mixtral"), device="cpu", dtype="bfloat16", kv_cache_tokens=64
        )
    [line] = [e for e in logs if e["event"] == "CPU kernels"]
    # the avx512 build's decode attention takes its VNNI copy where the CPU (or SIMDe) has it
    vnni = path.isa == "avx512" and (path.emulated or "avx512_vnni" in cpu_kernels.cpu_flags())
    assert (
        line["isa"] == path.isa
        and line["linear"] == path.isa
        and line["decode_attention"] == (f"{path.isa}+vnni" if vnni else path.isa)
    )
    assert line["moe_batch"] == ("amx" if path.amx else path.isa)


def test_compile_is_ignored_on_the_kernels(model_dirs, path):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        engine = LLMEngine.from_pretrained(
            model_dirs("mixtral"), device="cpu", dtype="bfloat16", kv_cache_tokens=64, compile=True
        )
    assert engine.runner.decode_model is engine.executor.fused_step  # not a compiled model
    assert any(e["event"] == "not compiling: decode steps run on the CPU kernels" for e in logs)


def test_all_kernels_off_runs_atens_kernels_on_row_major_weights(model_dirs):
    try:
        cpu_kernels.enable(None)
        engine = LLMEngine.from_pretrained(
            model_dirs("mixtral"), device="cpu", dtype="bfloat16", kv_cache_tokens=64
        )
        assert engine.executor.model.layers[0].attn.wqkv.weight.dim() == 2  # not packed
        assert not engine.runner.paged_kernel
        [out] = engine.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
        assert len(out.token_ids) == 4
    finally:
        cpu_kernels.enable()
