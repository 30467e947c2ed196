"""8-bit weights and KV caches in the engine (issue 19): every architecture quantized stays
within stated tolerances of its bf16 engine; the torch path (the one CUDA takes) agrees with
the kernels; FP8 checkpoints in both published layouts load and match their dequantized bf16
twin; an 8-bit cache holds about twice the tokens in the same bytes; prefix caching and
preemption work on it; bad settings are clear errors.

Closeness is measured on prompt logprobs (SamplingParams.prompt_logprobs) over prompts
prefilled in chunks of 8 tokens, so every chunk after the first attends over the cache as
stored: mean |logprob - bf16's logprob| per prompt token, on random-weight models whose
logprobs average about -8.8."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from inference import LLMEngine, SamplingParams
from inference.errors import InvalidParameterError, ModelLoadError
from inference.executor import kv_cache as kv_alloc
from inference.kernels import cpu as cpu_kernels
from inference.models import paged_cache as kv_cache
from inference.quantization.qweight import QWeight
from tests.inference.fp8_checkpoints import write_fp8_checkpoint
from tests.inference.parity_checks import prompts
from tests.inference.test_cpu_kernels import (  # every family, and the fixture
    ARCHS,
    arch_dirs,  # noqa: F401
)

# mean |d logprob| bounds, about twice what each format measured on these models (int8
# weights 0.022-0.029, fp8 weights 0.057-0.065, int8 KV 0.006-0.009, fp8 e4m3 KV
# 0.013-0.027, e5m2 0.017-0.050)
TOLERANCES = {
    (("quantization", "int8"),): 0.06,
    (("quantization", "fp8"),): 0.13,
    (("kv_cache_dtype", "int8"),): 0.02,
    (("kv_cache_dtype", "fp8_e4m3"),): 0.06,
    (("kv_cache_dtype", "fp8_e5m2"),): 0.1,
    (("quantization", "int8"), ("kv_cache_dtype", "int8")): 0.07,
}


def engine(path, **options) -> LLMEngine:
    options = {
        "max_num_batched_tokens": 8,
        "enable_prefix_caching": False,
        "kv_cache_tokens": 1024,
        **options,
    }
    return LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16", **options)


def prompt_logprobs(eng: LLMEngine, batch: list[list[int]]) -> torch.Tensor:
    outs = eng.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_quantized_stays_close_to_bf16(arch_dirs, arch):  # noqa: F811
    path = arch_dirs(arch)
    base = engine(path)
    batch = prompts(base.args.vocab_size, [40, 33])
    reference = prompt_logprobs(base, batch)
    for options, bound in TOLERANCES.items():
        quantized = engine(path, **dict(options))
        error = (prompt_logprobs(quantized, batch) - reference).abs().mean().item()
        assert error < bound, (arch, options, error)
        if dict(options).get("quantization"):  # fp8 keeps the lm_head (and the embeddings) in bf16
            assert quantized.weight_bytes < 0.9 * base.weight_bytes


def test_8bit_weights_are_8bit_in_memory(model_dirs):
    path = model_dirs("mixtral")
    eng = engine(path, quantization="int8")
    moe = eng.executor.model.layers[0].mlp
    assert isinstance(moe.experts.w13, QWeight) and moe.experts.w13.data.element_size() == 1
    # in the kernels' layout where they run (MOESERVE_BF16_KERNELS=0: row-major, torch path)
    assert moe.experts.w13.packed == (cpu_kernels.ISA is not None)
    assert isinstance(eng.executor.model.layers[0].attn.wqkv.weight, QWeight)
    assert not isinstance(moe.gate.weight, QWeight)  # the router stays bf16


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_torch_path_computes_what_the_kernels_do(model_dirs, fmt):
    """CPUs without our kernels (and CUDA) run quantization/qweight.py's torch path: int8 W8A8 through
    torch._int_mm, fp8 weight-only."""
    path = model_dirs("qwen2_moe")
    batch = prompts(1000, [30])
    kernels = prompt_logprobs(engine(path, quantization=fmt), batch)
    try:
        cpu_kernels.enable(None)
        torch_path = engine(path, quantization=fmt)
        assert not torch_path.runner.paged_kernel
        ours = prompt_logprobs(torch_path, batch)
    finally:
        cpu_kernels.enable()
    assert (ours - kernels).abs().mean().item() < 0.02


@pytest.fixture(scope="module")
def fp8_checkpoints(model_dirs, tmp_path_factory):
    def get(arch: str, layout: str):
        root = tmp_path_factory.getbasetemp() / f"fp8-{arch}-{layout}"
        fp8, twin = root / "fp8", root / "twin"
        if not (fp8 / "config.json").exists():
            write_fp8_checkpoint(model_dirs(arch), fp8, twin, layout)
        return fp8, twin

    return get


@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_fp8_checkpoints_load_and_match_their_dequantized_twin(fp8_checkpoints, arch, layout):
    fp8, twin = fp8_checkpoints(arch, layout)
    config = json.loads((fp8 / "config.json").read_text())
    assert "quantization_config" in config
    served = engine(fp8)  # the checkpoint's own format by default
    assert served.quantization == "fp8"
    twin_engine = engine(twin)
    batch = prompts(served.args.vocab_size, [40])
    reference = prompt_logprobs(twin_engine, batch)
    # weights as published (fp8 times its scale, in float32 in the kernel) against the same
    # weights rounded to bf16
    assert (prompt_logprobs(served, batch) - reference).abs().mean().item() < 0.03
    assert served.weight_bytes < 0.8 * twin_engine.weight_bytes
    # asked for no quantization, the checkpoint dequantizes into exactly the twin's weights
    assert torch.equal(prompt_logprobs(engine(fp8, quantization="none"), batch), reference)


def test_an_fp8_checkpoint_without_its_scales_is_refused(fp8_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _ = fp8_checkpoints("mixtral", "block")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in fp8.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    scale = next(n for n in tensors if n.endswith("_scale_inv"))
    del tensors[scale]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no weight_scale_inv or weight_scale"):
        engine(broken)


def test_a_checkpoint_in_another_quantization_scheme_is_refused(model_dirs, tmp_path):
    src = model_dirs("mixtral")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}  # (GPTQ loads: 4-bit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method = 'hqq'"):
        engine(tmp_path)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_an_8bit_cache_holds_twice_the_tokens_in_the_same_bytes(model_dirs, fmt):
    """The engine sizes --kv-cache-bytes by each format's bytes per token: 8-bit rows carry
    a 2-byte scale per (token, head): 2d / (d + 2) times the tokens of bf16, 1.78x at this
    test model's head width of 16, 1.94x at 64 (the small demo model, Mixtral, Qwen) and
    1.97x at 128."""
    path = model_dirs("mixtral")
    budget = 1 << 22
    plain = engine(path, kv_cache_tokens=None, kv_cache_bytes=budget)
    small = engine(path, kv_cache_tokens=None, kv_cache_bytes=budget, kv_cache_dtype=fmt)
    assert plain.kv_cache_bytes <= budget and small.kv_cache_bytes <= budget
    assert small.executor.kv_caches[0][0].element_size() == 1
    d = plain.args.head_dim
    expected = 2 * d / (d + kv_cache.SCALE_BYTES)
    assert small.kv_cache_tokens / plain.kv_cache_tokens == pytest.approx(expected, rel=0.01)
    for width in (64, 128):
        args = dataclasses.replace(plain.args, head_dim=width)
        ratio = kv_alloc.kv_bytes_per_token(args, torch.bfloat16) / kv_alloc.kv_bytes_per_token(
            args, kv_cache.storage_dtype(fmt, torch.bfloat16)
        )
        assert ratio >= 1.9


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_prefix_caching_and_preemption_work_on_an_8bit_cache(model_dirs, fmt):
    """A batch sharing a 32-token prefix through a cache far too small for it (preemptions):
    every request completes, every block comes back, and each token it chose is what a roomy
    cache of the same format ranks top (or within a near-tie of it: these random models'
    logits are nearly flat, so greedy paths of two cache layouts may part at a tie). The
    prefix is then served from the cache."""
    path = model_dirs("mixtral")
    prefix = prompts(1000, [32])[0]
    batch = [prefix + tail for tail in prompts(1000, [5, 9, 14, 20])]
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
    tight = engine(
        path,
        kv_cache_dtype=fmt,
        kv_cache_tokens=96,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    preempted = []
    tight.scheduler.on_preempt = preempted.append
    outs = tight.generate(batch, params)
    assert preempted and all(o.finish_reason == "length" for o in outs)
    assert tight.block_manager.num_used == 0  # every block back
    roomy = engine(path, kv_cache_dtype=fmt, kv_cache_tokens=2048)
    scored = roomy.generate(
        [p + o.token_ids for p, o in zip(batch, outs)],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
    )
    for prompt, out in zip(batch, scored):
        for lp in out.prompt_logprobs[len(prompt) :]:
            assert lp.logprob >= lp.top[0].logprob - 0.25, (lp.logprob, lp.top[0].logprob)
    cached = engine(path, kv_cache_dtype=fmt, kv_cache_tokens=2048, enable_prefix_caching=True)
    cached.generate([batch[0]], params)
    [again] = cached.generate([batch[1]], params)
    assert again.num_cached_tokens == 32


@pytest.mark.parametrize(
    "options,param",
    [
        ({"quantization": "int3"}, "quantization"),
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
        ({"kv_cache_bytes": 1 << 20}, "kv_cache_bytes"),  # with kv_cache_tokens set
        ({"kv_cache_tokens": None, "kv_cache_bytes": 0}, "kv_cache_bytes"),
    ],
)
def test_bad_settings_are_clear_errors(model_dirs, options, param):
    with pytest.raises(InvalidParameterError) as err:
        engine(model_dirs("mixtral"), **options)
    assert err.value.param == param
