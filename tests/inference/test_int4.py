"""int4 weights (W4A8, issue 40): quantized at load from a float checkpoint, groups of 128
inputs, rotated as int8's. The engine's logits stay close to a float32 model holding the
same weights dequantized (what is left is the int8 activations' rounding); greedy generation
runs; the arithmetic is the one documented in quantization/qweight.py; bad values are still
clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference import LLMEngine, SamplingParams
from inference.errors import InvalidParameterError
from inference.executor.quantize import kept_wide
from inference.models.layers import Linear
from inference.models.moe import Experts
from inference.quantization import qweight as quant
from inference.quantization.int4_search import quantize_int4_searched
from tests.inference.parity_checks import prompts
from tests.inference.test_cpu_kernels import (  # every family, and the fixture
    ARCHS,
    arch_dirs,  # noqa: F401
)

# mean |d logprob| against bf16, about twice the most measured on these random-weight models
# (0.04 the dense llama, 0.11-0.27 the MoE families; int8's 0.022-0.029): 16 levels a group
# where int8 has 255
INT4_TOLERANCE = 0.5


def engine(path, dtype="bfloat16", **options) -> LLMEngine:
    options = {
        "max_num_batched_tokens": 8,
        "enable_prefix_caching": False,
        "kv_cache_tokens": 1024,
        **options,
    }
    return LLMEngine.from_pretrained(path, device="cpu", dtype=dtype, **options)


def prompt_logprobs(eng: LLMEngine, batch: list[list[int]]) -> torch.Tensor:
    outs = eng.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])


def dequantized_twin(path) -> LLMEngine:
    """A float32 engine whose weights are replaced by what int4 serves, dequantized: every
    layer quantize_model quantizes, int4 by int4_search's default choices (the lm_head, the
    embedding and the sensitive projections int8, as int4 keeps them)."""
    eng = engine(path, dtype="float32")
    layers = len(eng.executor.model.layers)

    def int4(w: torch.Tensor) -> torch.Tensor:
        return quantize_int4_searched(w, quant.INT4_GROUP, "search", rotated=True).dequantize()

    for name, module in eng.executor.model.named_modules():
        if type(module) is Linear:
            wide = name == "lm_head" or kept_wide(name, layers)
            w = module.weight.data
            module.weight.data.copy_(quant.quantize_int8(w).dequantize() if wide else int4(w))
        elif isinstance(module, Experts):
            for w in (module.w13, module.w2):
                w.data.copy_(int4(w.data))
        elif isinstance(module, nn.Embedding):
            module.weight.data.copy_(quant.quantize_int8(module.weight.data).dequantize())
    return eng


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_int4_logits_stay_close_to_the_dequantized_float_model(model_dirs, arch):
    path = model_dirs(arch)
    int4 = engine(path, quantization="int4")
    assert int4.quantization == "int4"
    batch = prompts(int4.args.vocab_size, [40, 33])
    ours = prompt_logprobs(int4, batch)
    twin = prompt_logprobs(dequantized_twin(path), batch)
    bf16 = prompt_logprobs(engine(path), batch)
    # int8 activations and bf16 rounding only: about as close as int8's W8A8 to bf16 (0.06)
    twin_error = (ours - twin).abs().mean().item()
    assert twin_error < 0.06, twin_error
    # and int4's own weight error is the larger part of its distance to the bf16 model
    assert (ours - bf16).abs().mean().item() > twin_error


def test_int4_layers_are_quantized_as_int8_ones_are(model_dirs):
    eng = engine(model_dirs("mixtral"), quantization="int4")
    model = eng.executor.model
    layer = model.layers[0]
    attn_weight = layer.attn.wo.weight
    assert attn_weight.fmt == "int4" and attn_weight.group == quant.INT4_GROUP
    assert layer.attn.wqkv.weight.fmt == "int8"  # every layer's q/k/v (Int4Choices.wide)
    experts = layer.mlp.experts  # QuantExperts, or the MoE kernel's CpuExperts
    assert experts.w13.fmt == experts.w2.fmt == "int4"
    assert not isinstance(layer.mlp.gate.weight, quant.QWeight)  # the router stays bf16
    # the lm_head int8, on the int8 kernels where they run (QuantLinear's torch path if not)
    assert isinstance(model.lm_head.weight, quant.QWeight) and model.lm_head.weight.fmt == "int8"


def test_greedy_generation_runs_on_int4(model_dirs):
    eng = engine(model_dirs("mixtral"), quantization="int4")
    batch = prompts(eng.args.vocab_size, [12, 7])
    greedy = SamplingParams(max_tokens=6, temperature=0)
    first = [o.token_ids for o in eng.generate(batch, greedy)]
    assert [len(t) for t in first] == [6, 6]
    # the same tokens alone as in a batch: per-token activation scales, no cross-row state
    assert [o.token_ids for o in eng.generate(batch[1:], greedy)] == first[1:]


def test_int4_values_use_all_16_levels_and_their_group_scales():
    w = torch.randn(24, 300, generator=torch.Generator().manual_seed(0))
    for rotated in (True, False):
        qw = quant.quantize_int4(w, rotated=rotated)
        assert qw.scale.shape == (3, 24) and qw.data.shape == (24, 300)
        assert int(qw.data.min()) == -8 and int(qw.data.max()) == 7
        # the value of largest magnitude in each group lands on -8 exactly
        for start in range(0, 300, 128):
            assert (qw.data[:, start : start + 128] == -8).any(-1).all()
        error = (qw.dequantize() - w).pow(2).mean() / w.pow(2).mean()
        assert error < 0.015  # ~1% of the weights' energy: a 16-level grid per 128 inputs


def test_int4_linear_is_the_documented_order_of_float_sums():
    """The torch reference's floats: each group's exact integer sum times its scale, added in
    order in float32, then times the row's scale."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(20, 300, generator=g), torch.randn(3, 300, generator=g)
    qw = quant.quantize_int4(w)
    q, sx = quant.quantize_activations(x, qw)
    expect = torch.zeros(3, 20)
    for i in range(3):
        for n in range(20):
            acc = torch.tensor(0.0)
            for gi, start in enumerate(range(0, 300, 128)):
                part = slice(start, start + 128)
                s = sum(int(a) * int(b) for a, b in zip(q[i, part], qw.data[n, part]))
                acc = acc + torch.tensor(float(s)) * qw.scale[gi, n]
            expect[i, n] = acc * sx[i]
    assert torch.equal(quant.linear(x, qw), expect)


def test_a_bad_quantization_is_still_a_clear_error(model_dirs):
    with pytest.raises(InvalidParameterError) as err:
        engine(model_dirs("mixtral"), quantization="int3")
    assert err.value.param == "quantization"


def test_the_rotation_can_be_switched_off_to_measure_it(model_dirs, monkeypatch):
    """MOESERVE_INT4_ROTATE=0 (bench/quant_bench.py's int4_unrotated row): unrotated values,
    activations unrotated to match; the int8 lm_head keeps its rotation."""
    monkeypatch.setenv("MOESERVE_INT4_ROTATE", "0")
    eng = engine(model_dirs("mixtral"), quantization="int4")
    model = eng.executor.model
    assert not model.layers[0].attn.wo.weight.rotated  # an int4 projection (q/k/v: int8)
    assert not model.layers[0].mlp.experts.w13.rotated
    assert model.lm_head.weight.rotates
    outs = eng.generate(prompts(eng.args.vocab_size, [9]), SamplingParams(max_tokens=3))
    assert len(outs[0].token_ids) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_on_int4_stays_close_to_bf16(arch_dirs, arch):  # noqa: F811
    """Every family on int4 (on the kernels where they run: gpt-oss's biased, clamped experts,
    MLA, shared experts, tied embeddings...): mean |d logprob| against its bf16 engine."""
    path = arch_dirs(arch)
    base = engine(path)
    batch = prompts(base.args.vocab_size, [40, 33])
    int4 = engine(path, quantization="int4")
    error = (prompt_logprobs(int4, batch) - prompt_logprobs(base, batch)).abs().mean().item()
    assert error < INT4_TOLERANCE, (arch, error)
    assert int4.weight_bytes < 0.9 * base.weight_bytes
