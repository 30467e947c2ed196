"""The Python API: bad inputs, abort, stop strings, n > 1, seeds, the async engine."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference import (
    AsyncLLMEngine,
    InvalidParameterError,
    LLMEngine,
    ModelLoadError,
    QueueFullError,
    SamplingParams,
)
from tests.inference.parity_checks import DEVICE


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_pretrained(
        tiny_model_dir, device=DEVICE, dtype="float32", kv_cache_tokens=1024, max_model_len=256
    )


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**9], SamplingParams(), "prompt"),
        ("x " * 400, SamplingParams(), "prompt"),
        ([5] * 200, SamplingParams(max_tokens=100), "max_tokens"),
        (3.5, SamplingParams(), "prompt"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_inputs_raise_clear_errors(engine, prompt, params, param):
    with pytest.raises(InvalidParameterError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == param
    assert not engine.has_unfinished


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)


def test_abort_mid_generation_frees_every_block(engine):
    engine.add_request("long", [3, 4, 5] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("other", [7, 8] * 20, SamplingParams(max_tokens=100, ignore_eos=True, n=2))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used > 0
    out = engine.abort("long")
    assert out.finished and out.finish_reason == "abort" and 0 < len(out.token_ids) < 100
    engine.abort("other")
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished
    _, stats = engine.step()
    assert sorted(f.finish_reason for f in stats.finished) == ["abort"] * 3


def test_stop_string_spanning_tokens(engine):
    prompt = [11, 12, 13, 14]
    [free] = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    tok = engine.tokenizer
    # a stop string made of the end of token 3 and the start of token 4's text
    t3, t4 = tok.decode(free.token_ids[3:4]), tok.decode(free.token_ids[4:5])
    head = tok.decode(free.token_ids[:3])
    stop = (t3[-1:] + t4[:1]) if t3 and t4 else t4
    [cut] = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert stop not in cut.text and free.text.startswith(cut.text) and len(cut.text) >= len(head)
    assert cut.text == free.text[: free.text.find(stop)]


def test_eos_and_stop_token_ids_finish_with_stop(engine):
    [free] = engine.generate(
        [[20, 21, 22]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    target = free.token_ids[2]
    [cut] = engine.generate(
        [[20, 21, 22]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[target])
    )
    assert (
        cut.finish_reason == "stop"
        and cut.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    )


def test_skip_special_tokens_false_keeps_their_text_but_not_an_ending_eos(engine):
    tok = engine.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")  # special, not an end of sequence
    assert special in tok.all_special_ids and special not in engine.eos_token_ids
    eos = next(iter(engine.eos_token_ids))
    for skip in (True, False):
        params = SamplingParams(
            max_tokens=3, temperature=0, logit_bias={special: 100.0}, skip_special_tokens=skip
        )
        [out] = engine.generate([[5, 6, 7]], params)
        assert out.token_ids == [special] * 3
        assert out.text == ("" if skip else "<|im_start|>" * 3)
        ended = SamplingParams(max_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=skip)
        [out] = engine.generate([[5, 6, 7]], ended)
        assert out.token_ids == [eos] and out.text == "" and out.finish_reason == "stop"


def test_n_samples_and_seed_reproducibility(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=123, n=3, ignore_eos=True)
    [a] = engine.generate(["hello there"], params)
    [b] = engine.generate(["hello there", "another prompt in the batch", "x"], params)[:1]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_logprobs_in_outputs(engine):
    [out] = engine.generate(
        ["abc"], SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    )
    lps = out.outputs[0].logprobs
    assert len(lps) == 4 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in lps)
    assert [lp.token_id for lp in lps] == out.token_ids


def test_loader_errors(tiny_model_dir, tmp_path):
    def copy(name):
        dst = tmp_path / name
        shutil.copytree(tiny_model_dir, dst)
        return dst

    bad_arch = copy("arch")
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLMEngine.from_pretrained(bad_arch, device="cpu")

    # a rope scaling whose tables depend on the sequence is refused for every family
    dynamic = copy("dynamic-rope")
    cfg = json.loads((dynamic / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    (dynamic / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic' is not supported"):
        LLMEngine.from_pretrained(dynamic, device="cpu")

    missing = copy("missing")
    weights = load_file(missing / "model.safetensors")
    weights.pop("model.layers.1.self_attn.o_proj.weight")
    save_file(weights, missing / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks weights for: layers.1.attn.wo.weight"):
        LLMEngine.from_pretrained(missing, device="cpu")

    shaped = copy("shape")
    weights = load_file(shaped / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, shaped / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match="'model.norm.weight' has shape \\(3,\\), expected \\(64,\\)"
    ):
        LLMEngine.from_pretrained(shaped, device="cpu")

    no_tok = copy("notok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        LLMEngine.from_pretrained(no_tok, device="cpu")


def test_sharded_checkpoint_loads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = LLMEngine.from_pretrained(
        sharded, device="cpu", dtype="float32", kv_cache_tokens=256
    ).generate(["hi"], params)
    b = LLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=256
    ).generate(["hi"], params)
    assert a[0].token_ids == b[0].token_ids


async def test_async_stream_deltas_abort_and_back_pressure(tiny_model_dir):
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        kv_cache_tokens=1024,
        max_waiting=2,
        max_num_seqs=1,
    )
    engine.start()
    try:
        pieces, last = [], None
        async for out in engine.stream(
            "streaming test", SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
        ):
            pieces.append(out.outputs[0].delta_text)
            last = out
        assert last.finished and "".join(pieces) == last.text and len(last.token_ids) == 10

        agen = engine.stream("to be cancelled", SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            if len(out.token_ids) >= 2:
                break
        await agen.aclose()
        for _ in range(100):
            if engine.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.kv_blocks_used == 0

        # max_num_seqs=1 and max_waiting=2: a burst sees some requests shed, none lost
        async def one(i):
            try:
                return (
                    await engine.generate(f"p{i}", SamplingParams(max_tokens=3, ignore_eos=True))
                ).finish_reason
            except QueueFullError:
                return "rejected"

        results = await asyncio.gather(*[one(i) for i in range(8)])
        assert "rejected" in results and "length" in results
        assert set(results) <= {"rejected", "length"}
    finally:
        await engine.shutdown()
    assert not engine.is_alive
