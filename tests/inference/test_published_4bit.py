"""4-bit checkpoints as people publish them (issue 40): GPTQ (symmetric, asymmetric, groups of
128 and per channel, act-order), AWQ (GEMM packing) and compressed-tensors pack-quantized
(group and channel, symmetric and asymmetric), made by the library that publishes them
(tests/inference/published_4bit.py says which). Each loads on every layer kind it covers
(experts, attention, the dense shared-expert MLP) with what it keeps in 16 bits (routers,
norms, lm_head) as it is:

- its weights unpack to the library's own dequantization;
- served dequantized (--quantization none), its logits are the library-dequantized model's;
- served as published (the default), in 4 bits, its logits stay as close to that model as
  our int4 W4A8 does to its own dequantized weights (int8 activations only); act-order GPTQ
  too (qwen2_moe, qwen3_moe and a dense llama; groups of 32 and 128, symmetric or not);
- ModelInfo's quantization names the format;
- variants we do not serve are refused naming the config field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inference import LLMEngine, SamplingParams
from inference.errors import ModelLoadError
from inference.executor.loader import int4_reader
from inference.executor.quantize import QuantExperts, QuantLinear
from tests.inference import published_4bit as pub
from tests.inference.parity_checks import prompts

pytest.importorskip("auto_round")
pytest.importorskip("compressed_tensors")

FORMAT_OF = {
    "auto_gptq": "gptq",
    "auto_awq": "awq",
    "llm_compressor": "compressed-tensors",
    "auto_round": "auto-round",
}
# our int4 W4A8 against its own dequantized weights (tests/inference/test_int4.py): the int8
# activations' rounding and bf16's
W4A8_TOLERANCE = 0.06


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """variant -> the library-made checkpoint folder (made on first use)."""
    root = tmp_path_factory.mktemp("published_4bit")
    made: dict[tuple[str, str], object] = {}

    def get(variant: str, arch: str = pub.ARCH):
        if (variant, arch) not in made:
            src = pub.source_model(root, arch)
            out = root / (variant if arch == pub.ARCH else f"{arch}-{variant}")
            made[variant, arch] = pub.autoround_checkpoint(src, out, variant)
        return made[variant, arch]

    return get


def engine(path, dtype="bfloat16", **options) -> LLMEngine:
    options = {"max_num_batched_tokens": 8, "enable_prefix_caching": False, **options}
    return LLMEngine.from_pretrained(
        path, device="cpu", dtype=dtype, kv_cache_tokens=256, **options
    )


def prompt_logprobs(eng: LLMEngine, batch: list[list[int]]) -> torch.Tensor:
    outs = eng.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("variant", sorted(pub.VARIANTS))
def test_weights_unpack_as_the_publishing_library_dequantizes_them(published, variant):
    path = published(variant)
    qc = pub.quantization_config(path)
    method = qc["quant_method"]
    assert method == FORMAT_OF[pub.VARIANTS[variant][0]]
    fmt, scheme = int4_reader(qc)
    tensors = pub.read_all(path)
    modules = pub.quantized_modules(path)
    kinds = {m.split(".mlp.")[-1].split(".")[0] if ".mlp." in m else "self_attn" for m in modules}
    assert kinds == {"experts", "shared_expert", "self_attn"}  # every layer kind, quantized
    for module in modules:
        parts = {p: tensors[f"{module}.{p}"] for p in fmt.PARTS if f"{module}.{p}" in tensors}
        unpacked = fmt.unpack(parts, scheme, module)
        (levels,) = unpacked if isinstance(unpacked, list) else [unpacked]
        reference = pub.REFERENCES[method](tensors, module, qc)
        # the libraries compute in their scales' fp16 / bf16: equal to that rounding
        torch.testing.assert_close(levels.dequantize(), reference, rtol=2**-9, atol=0)
    # what the library kept in 16 bits is in the checkpoint as it was
    assert "model.layers.0.mlp.gate.weight" in tensors and "lm_head.weight" in tensors


@pytest.mark.parametrize(
    "variant", ["gptq-asym-g128", "awq-g128", "ct-asym-channel", "autoround-sym-g128"]
)
def test_logits_match_the_library_dequantized_model(published, variant, tmp_path):
    path = published(variant)
    method = pub.quantization_config(path)["quant_method"]
    twin_path = pub.dequantized_twin(path, tmp_path / "twin")
    batch = prompts(1024, [24, 17])
    twin = prompt_logprobs(engine(twin_path), batch)
    # dequantized at load: the library's weights (up to their own fp16 rounding) in bf16
    plain = engine(path, quantization="none")
    assert plain.quantization == "none"
    assert (prompt_logprobs(plain, batch) - twin).abs().max().item() < 0.02
    # served as published, in 4 bits: only the int8 activations' rounding on top
    served = engine(path)
    assert served.quantization == method
    error = (prompt_logprobs(served, batch) - twin).abs().mean().item()
    assert error < W4A8_TOLERANCE, error
    assert served.weight_bytes < plain.weight_bytes
    out = served.generate(batch[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_the_published_weights_are_served_in_four_bits_where_quantized(published):
    eng = engine(published("gptq-asym-g128"), dtype="float32")  # torch's path: modules seen
    model = eng.executor.model
    layer = model.layers[0]
    attn, mlp = layer.attn.wqkv, layer.mlp
    assert isinstance(attn, QuantLinear) and attn.weight.fmt == "int4"
    assert attn.weight.zero is not None and not attn.weight.rotated  # asymmetric, as published
    assert attn.weight.group == 128
    experts = mlp.moe.experts if hasattr(mlp, "moe") else mlp.experts
    assert isinstance(experts, QuantExperts) and experts.w13.fmt == "int4"
    # 16 bits where the checkpoint kept them: the router, the lm_head, the embedding
    assert type(model.lm_head).__name__ == "Linear"
    assert isinstance(model.embed, torch.nn.Embedding)


def test_symmetric_checkpoints_carry_no_zero_points(published):
    eng = engine(published("gptq-sym-g128"), dtype="float32")
    assert eng.executor.model.layers[0].attn.wqkv.weight.zero is None


# act-order checkpoints (published_4bit.act_order_gptq over AutoRound's GPTQ ones): id ->
# (architecture, variant); qwen2_moe has experts, a dense MLP (its shared expert) and
# attention, qwen3_moe experts alone, llama dense MLPs
ACT_ORDER = {
    "qwen2_moe-sym-g128": ("qwen2_moe", "gptq-sym-g128"),
    "qwen2_moe-asym-g32": ("qwen2_moe", "gptq-asym-g32"),
    "qwen3_moe-asym-g128": ("qwen3_moe", "gptq-asym-g128"),
    "llama-sym-g32": ("llama", "gptq-sym-g32"),
    "llama-asym-g128": ("llama", "gptq-asym-g128"),
}


def act_order_checkpoint(published, tmp_path, case: str, **options):
    arch, variant = ACT_ORDER[case]
    return pub.act_order_gptq(published(variant, arch), tmp_path / "act_order", True, **options)


def mlps(model) -> list:
    """Every MLP's modules holding w13 and w2: experts (a stack) and dense MLPs."""
    found = []
    for layer in model.layers:
        mlp = layer.mlp
        moe = getattr(mlp, "moe", mlp)
        if hasattr(moe, "experts"):
            found.append(moe.experts)
        for dense in (getattr(mlp, "shared", None), mlp if hasattr(mlp, "w13") else None):
            if dense is not None:
                found.append(dense)
    return found


def weight_of(module):
    return module.weight if hasattr(module, "weight") else module


@pytest.mark.parametrize("case", sorted(ACT_ORDER))
def test_act_order_checkpoints_are_served_in_four_bits_and_match_the_library(
    published, tmp_path, case
):
    """Every layer kind of an act-order checkpoint (experts, attention, dense MLPs) served
    in 4 bits, its activations gathered into each weight's input order (the down
    projections' folded into gate/up's rows): the logits stay as close to the
    library-dequantized model as W4A8 does, on torch's path (float32) and on the kernels
    with the one-call decode step (bf16)."""
    path = act_order_checkpoint(published, tmp_path, case)
    twin_path = pub.dequantized_twin(path, tmp_path / "twin")
    batch = prompts(1024, [24, 17])
    twin = prompt_logprobs(engine(twin_path), batch)
    for dtype in ("float32", "bfloat16"):
        served = engine(path, dtype=dtype)
        assert served.quantization == "gptq"
        model = served.executor.model
        attn = model.layers[0].attn
        # (a weight of one group a row, 128 inputs in groups of 128, needs no order)
        for w in (weight_of(attn.wqkv), weight_of(attn.wo)):
            assert w.fmt == "int4" and (w.perm is not None) == (w.group < w.in_features)
        for mlp in mlps(model):
            w13, w2 = weight_of(mlp.w13), weight_of(mlp.w2)
            assert w13.fmt == w2.fmt == "int4" and w2.group < w2.in_features
            assert (w13.perm is not None) == (w13.group < w13.in_features)
            assert w2.perm is None  # w2's order folded into w13's rows
        if dtype == "bfloat16":
            assert served.executor.fused_step is not None
        error = (prompt_logprobs(served, batch) - twin).abs().mean().item()
        assert error < W4A8_TOLERANCE, (dtype, error)
        out = served.generate(
            batch[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        )
        assert len(out[0].token_ids) == 4


def test_fused_parts_in_different_act_orders_are_served_from_their_16_bit_weights(
    published, tmp_path
):
    """q/k/v or gate/up whose g_idx give different orders (no GPTQ run writes them: one
    input, one Hessian) cannot share one gather: those fused weights are served dequantized,
    the rest in 4 bits, and the logits still match the library."""
    path = act_order_checkpoint(published, tmp_path, "qwen2_moe-asym-g32", one_order_an_input=False)
    twin_path = pub.dequantized_twin(path, tmp_path / "twin")
    batch = prompts(1024, [20])
    twin = prompt_logprobs(engine(twin_path), batch)
    served = engine(path, dtype="float32")
    layer = served.executor.model.layers[0]
    assert not isinstance(layer.attn.wqkv, QuantLinear) and not isinstance(
        layer.mlp.moe.experts, QuantExperts
    )
    assert isinstance(layer.attn.wo, QuantLinear) and layer.attn.wo.weight.perm is not None
    shared = layer.mlp.shared
    assert not isinstance(shared.w13, QuantLinear)
    assert shared.w2.weight.perm is not None  # gathered at run time: no 4-bit gate/up to fold into
    assert (prompt_logprobs(served, batch) - twin).abs().mean().item() < W4A8_TOLERANCE


@pytest.mark.parametrize(
    "variant,change,field",
    [
        ("gptq-sym-g128", {"bits": 3}, "quantization_config.bits"),
        ("gptq-sym-g128", {"bits": 8}, "quantization_config.bits"),
        ("gptq-sym-g128", {"checkpoint_format": "marlin"}, "checkpoint_format"),
        (
            "gptq-sym-g128",
            {"dynamic": {r"+:.*self_attn.*": {"bits": 8}}},
            "quantization_config.dynamic",
        ),
        ("awq-g128", {"version": "gemv"}, "quantization_config.version"),
        ("awq-g128", {"bits": 2}, "quantization_config.bits"),
        ("ct-sym-g128", {"format": "marlin-24"}, "format"),
        ("ct-sym-g128", {"weights": {"num_bits": 8}}, "weights.num_bits"),
        ("ct-sym-g128", {"weights": {"strategy": "tensor"}}, "weights.strategy"),
        (
            "ct-sym-g128",
            {"input_activations": {"num_bits": 8, "type": "int"}},
            "input_activations",
        ),
        ("gptq-sym-g128", {"quant_method": "exl2"}, "quant_method"),
        ("autoround-sym-g128", {"packing_format": "auto_round:marlin"}, "packing_format"),
        (
            "autoround-sym-g128",
            {"extra_config": {"model.layers.0.self_attn.q_proj": {"bits": 8}}},
            "quantization_config.extra_config",
        ),
        ("autoround-sym-g128", {"data_type": "mx_fp"}, "quantization_config.data_type"),
    ],
)
def test_variants_we_do_not_serve_are_refused_naming_the_field(
    published, tmp_path, variant, change, field
):
    path = tmp_path / "variant"
    shutil.copytree(published(variant), path)
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    if qc["quant_method"] == "compressed-tensors" and "quant_method" not in change:
        (group,) = qc["config_groups"].values()
        for key, value in change.items():
            if isinstance(value, dict) and key == "weights":
                group["weights"].update(value)
            else:
                group[key] = value
    else:
        qc.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        engine(path)


# ---- gpt-oss's MXFP4 experts --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # torch's path; our CPU kernels
def test_mxfp4_experts_served_in_four_bits_stay_close_to_transformers(model_dirs, tmp_path, dtype):
    """transformers' own MXFP4 dequantization (Mxfp4Config(dequantize=True)) is the
    reference; served in 4 bits, only the int8 activations' rounding is added."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tests.inference.test_gpt_oss import write_mxfp4_checkpoint

    ckpt = write_mxfp4_checkpoint(model_dirs("gpt_oss"), tmp_path / "mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    batch = prompts(ref.config.vocab_size, [24])
    with torch.no_grad():
        logits = ref(torch.tensor(batch)).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(batch[0][1:]).unsqueeze(-1))
    served = engine(ckpt, dtype=dtype)
    assert served.quantization == "mxfp4"
    error = (prompt_logprobs(served, batch) - expected.squeeze(-1)).abs().mean().item()
    assert error < W4A8_TOLERANCE, error


def test_a_4bit_config_over_plain_weights_is_refused(model_dirs, tmp_path):
    shutil.copytree(model_dirs("mixtral"), tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"no \*\.qweight tensor"):
        engine(tmp_path / "plain")


def test_the_server_reports_the_published_format(published):
    """moeserve_model_info and gRPC ModelInfo name the checkpoint's format (SPEC section 13)."""
    import grpc
    import httpx

    from bench.harness import InProcessServer
    from service.proto.moeserve.v1 import inference_pb2 as pb
    from service.proto.moeserve.v1 import inference_pb2_grpc
    from tests.service.conftest import make_settings

    settings = make_settings(
        published("awq-g128"), dtype="bfloat16", grpc_port=0, kv_cache_tokens=1024
    )
    with InProcessServer(settings) as srv:
        text = httpx.get(srv.url + "/metrics").text
        info = next(s for s in text.splitlines() if s.startswith("moeserve_model_info{"))
        assert 'quantization="awq"' in info
        with grpc.insecure_channel(srv.grpc_target) as channel:
            reply = inference_pb2_grpc.InferenceStub(channel).ModelInfo(pb.ModelInfoRequest())
        assert reply.quantization == "awq"
        assert reply.weight_bytes == srv.engine.weight_bytes


def test_quantization_may_name_the_checkpoints_own_format_as_vllm_does(published):
    path = published("gptq-sym-g128")
    assert engine(path, dtype="float32", quantization="gptq").quantization == "gptq"
    with pytest.raises(ModelLoadError, match=r"--quantization awq .*'gptq'.*quant_method"):
        engine(path, dtype="float32", quantization="awq")
