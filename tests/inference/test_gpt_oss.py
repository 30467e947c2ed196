"""gpt-oss's own pieces (inference/models/gpt_oss.py): the decode-attention kernel with sinks
and sliding windows, the MoE kernel with expert biases and the clamped SwiGLU, checkpoints in
MXFP4 as published (against transformers' own dequantization and model), and the variants we
refuse. Its parity with transformers runs in test_parity.py, test_arch_variants.py and the
kernel and quantization tests, as every family's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference import LLMEngine, ModelLoadError, SamplingParams
from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache as kv_cache
from inference.models.moe import ClampedSwiGLU, select_experts
from tests.inference.family_checks import check_variant_refused
from tests.inference.test_cpu_kernels import (  # noqa: F401 (the fixture: every kernel path)
    close_to_bf16,
    close_to_int4_attention,
    path,
    randn,
)
from tests.inference.test_quant_kernels import caches


def sink_attention_reference(q, k_cache, v_cache, table, length, block_size, scale, sinks, window):
    """Float32 softmax over the last `window` positions and the head's sink logit."""
    first = max(0, length - window) if window else 0
    pos = torch.arange(first, length)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    h, g = q.shape[0], k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(h // g, 1).transpose(0, 1)  # [H, n, d]
    v = v_cache[slots].float().repeat_interleave(h // g, 1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.float(), k) * scale
    probs = torch.cat((scores, sinks.float()[:, None]), dim=1).softmax(dim=1)[:, :-1]
    return torch.einsum("hn,hnd->hd", probs, v)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("window", [0, 16, 100])
def test_decode_attention_honours_sinks_and_windows(path, fmt, window):  # noqa: F811
    bs, nblocks, heads, kv_heads, dim = 16, 80, 8, 2, 64
    lengths = [1, 9, 16, 17, 70, 1000]  # inside, at and past the window; one split over threads
    if fmt == "bf16":
        g = torch.Generator().manual_seed(0)
        kc = torch.randn(nblocks * bs, kv_heads, dim, generator=g).bfloat16()
        vc = torch.randn(nblocks * bs, kv_heads, dim, generator=g).bfloat16()
        kf, vf = kc, vc
    else:
        kc, vc = (
            caches(fmt, nblocks * bs, kv_heads, dim),
            caches(fmt, nblocks * bs, kv_heads, dim),
        )
        every = torch.arange(nblocks * bs)
        kv_cache.write_kv(kc, every, randn(nblocks * bs, kv_heads, dim, seed=7))
        kv_cache.write_kv(vc, every, randn(nblocks * bs, kv_heads, dim, seed=8))
        kf, vf = kv_cache.dequantize(kc, torch.float32), kv_cache.dequantize(vc, torch.float32)
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:64] for _ in lengths]).int()
    q = randn(len(lengths), heads, dim, seed=3)
    sinks = torch.randn(heads, generator=g) * 2  # some dominate a short context, some do not
    out = cpu_kernels.decode_attention(
        q, kc, vc, tables, torch.tensor(lengths, dtype=torch.int32), bs, 0.125, None, sinks, window
    )
    for b, n in enumerate(lengths):
        expected = sink_attention_reference(q[b], kf, vf, tables[b], n, bs, 0.125, sinks, window)
        (close_to_int4_attention if fmt == "int4" else close_to_bf16)(out[b], expected)


def clamped_expert_reference(x, w13, w2, b13, b2, ids, weights, glu):
    """gpt-oss's experts in float32, rounded to bf16 where its bf16 ops round."""
    out = torch.zeros(w2.shape[1])

    def r(t):
        return t.bfloat16().float()

    for e, wt in zip(ids.tolist(), weights.tolist()):
        h = r(r(w13[e].float() @ x.float()) + b13[e].float())
        gate, up = h.chunk(2)
        gate, up = gate.clamp(max=glu.limit), up.clamp(-glu.limit, glu.limit)
        act = r(r(up + 1) * r(gate * r(torch.sigmoid(r(gate * glu.alpha)))))
        out += wt * r(r(w2[e].float() @ act) + b2[e].float())
    return out


@pytest.mark.parametrize(
    "t,d,i,e,top_k", [(1, 64, 64, 8, 2), (5, 64, 48, 8, 4), (40, 32, 64, 4, 2)]
)
def test_moe_kernel_applies_biases_and_the_clamped_swiglu(path, t, d, i, e, top_k):  # noqa: F811
    """Both epilogues (the fused one, I a multiple of 16 columns, and the separate pass)."""
    w13, w2, x = (
        randn(e, 2 * i, d, scale=0.3),
        randn(e, d, i, scale=0.3, seed=1),
        randn(t, d, seed=2),
    )
    b13, b2 = randn(e, 2 * i, seed=4), randn(e, d, seed=5)
    glu = ClampedSwiGLU(1.702, 1.5)  # a low limit: the clamps bind
    g = torch.Generator().manual_seed(t)
    weights, ids = select_experts(torch.rand(t, e, generator=g).softmax(-1), top_k, True)
    b13f, b2f = b13.float().contiguous(), b2.float().contiguous()
    spec = cpu_kernels.MoeGlu(b13f.data_ptr(), b2f.data_ptr(), glu.alpha, glu.limit)
    out, _ = cpu_kernels.moe(
        x, cpu_kernels.pack_weight(w13), cpu_kernels.pack_weight(w2), ids, weights, spec
    )
    for row in range(t):
        exact = clamped_expert_reference(x[row], w13, w2, b13, b2, ids[row], weights[row], glu)
        torch.testing.assert_close(
            out[row].float(), exact, rtol=2**-7, atol=float(exact.abs().max()) * 2**-7
        )


# ---- MXFP4 checkpoints --------------------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (blocks [..., N, K/32, 16] uint8, scales [..., N, K/32] uint8): OCP MX
    e2m1 values in blocks of 32 with a shared power of two, the low nibble first."""
    blocks = w.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scaled = blocks / torch.exp2(exp)
    code = (scaled.abs().unsqueeze(-1) - _E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp.squeeze(-1) + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src, dst):
    """The demo checkpoint with its experts in MXFP4, as OpenAI publishes gpt-oss."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(name)  # [E, K, N] in the unquantized layout
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(w.transpose(1, 2))
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_mxfp4_experts_load_as_transformers_dequantizes_them(model_dirs, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = write_mxfp4_checkpoint(model_dirs("gpt_oss"), tmp_path / "mxfp4")
    # --quantization none: dequantized at load into the model's dtype
    engine = LLMEngine.from_pretrained(
        ckpt, dtype="float32", kv_cache_tokens=256, quantization="none"
    )
    tensors = load_file(ckpt / "model.safetensors")
    prefix = "model.layers.0.mlp.experts."
    gate_up = convert_moe_packed_tensors(
        tensors[prefix + "gate_up_proj_blocks"], tensors[prefix + "gate_up_proj_scales"]
    ).float()  # [E, D, 2I], gate and up interleaved
    down = convert_moe_packed_tensors(
        tensors[prefix + "down_proj_blocks"], tensors[prefix + "down_proj_scales"]
    ).float()  # [E, I, D]
    experts = engine.executor.model.layers[0].mlp.experts
    w13 = gate_up.transpose(1, 2)
    assert torch.equal(experts.w13, torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1))
    assert torch.equal(experts.w2, down.transpose(1, 2))
    assert engine.quantization == "none"
    # served as published (the default): the same weights, held in 4 bits
    served = LLMEngine.from_pretrained(ckpt, dtype="float32", kv_cache_tokens=256)
    assert served.quantization == "mxfp4"
    held = served.executor.model.layers[0].mlp.experts
    assert held.w13.fmt == held.w2.fmt == "mxfp4"
    assert torch.equal(held.w13.dequantize(), experts.w13)
    assert torch.equal(held.w2.dequantize(), experts.w2)


def test_an_mxfp4_checkpoint_decodes_as_transformers_does(model_dirs, tmp_path):
    """Greedy tokens of our engine on the MXFP4 checkpoint equal transformers' own model loading
    the same checkpoint (its MXFP4 dequantization on the CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    ckpt = write_mxfp4_checkpoint(model_dirs("gpt_oss"), tmp_path / "mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    prompt = list(range(5, 37))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24
        )[0, len(prompt) :].tolist()
    engine = LLMEngine.from_pretrained(
        ckpt, dtype="float32", kv_cache_tokens=256, quantization="none"
    )  # dequantized, as transformers runs it (in 4 bits: tests/inference/test_published_4bit.py)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out[0].token_ids == expected


@pytest.mark.parametrize(
    "edit,field",
    [
        (
            lambda t: t.update(
                {k: v[..., :-1].contiguous() for k, v in t.items() if k.endswith("_scales")}
            ),
            "_scales",
        ),
        (
            lambda t: t.update({k: v.int() for k, v in t.items() if k.endswith("_scales")}),
            "_scales",
        ),
        (
            lambda t: t.update(
                {k: v[..., :8].contiguous() for k, v in t.items() if k.endswith("_blocks")}
            ),
            "_blocks",
        ),
        (lambda t: [t.pop(k) for k in [k for k in t if k.endswith("_scales")]], "_scales"),
    ],
    ids=["scales-shape", "scales-dtype", "blocks-shape", "no-scales"],
)
def test_malformed_mxfp4_tensors_are_refused_naming_them(model_dirs, tmp_path, edit, field):
    ckpt = write_mxfp4_checkpoint(model_dirs("gpt_oss"), tmp_path / "mxfp4")
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=field):
        LLMEngine.from_pretrained(ckpt, dtype="float32", kv_cache_tokens=256)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type",
        ),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type",
        ),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_variants_we_do_not_serve_are_refused_naming_the_field(model_dirs, tmp_path, change, field):
    check_variant_refused(model_dirs("gpt_oss"), tmp_path / "variant", change, field)
