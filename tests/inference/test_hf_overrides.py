"""vLLM's --hf-overrides (inference/hf_overrides.py): a YaRN scaling given at load stretches a
Llama checkpoint's context as vLLM derives it (original positions times the factor), and
the engine then generates past the checkpoint's own length what transformers generates with
the same scaling written into config.json; malformed overrides are refused naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest

from inference import LLMEngine, SamplingParams
from inference.config import EngineConfig
from inference.errors import InvalidParameterError
from inference.executor.loader import load_hf_config
from inference.models.args import context_length
from tests.inference.parity_checks import DEVICE, hf_greedy, hf_model
from tests.inference.tiny_gguf import random_llama

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}  # over the config's 64 positions


@pytest.fixture(scope="module")
def short_llama(model_dirs, tmp_path_factory):
    """A random Llama of 64 positions and no scaling, as SmolLM2 ships (8,192 there)."""
    tok_dir = model_dirs("mixtral")
    path = tmp_path_factory.mktemp("short_llama")
    random_llama(tok_dir, seed=3, max_position_embeddings=64).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, path / f)
    return path


def test_a_yarn_override_stretches_the_context_as_vllm_derives_it(short_llama):
    plain = load_hf_config(short_llama)
    assert context_length(plain) == 64
    cfg = load_hf_config(short_llama, json.dumps(YARN))
    assert cfg.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,  # the checkpoint's, kept
        "factor": 4.0,
        "original_max_position_embeddings": 64,  # the checkpoint's length
    }
    assert context_length(cfg) == 256
    with pytest.raises(InvalidParameterError) as info:  # vLLM refuses it too, unscaled
        LLMEngine.from_pretrained(short_llama, device="cpu", dtype="float32", max_model_len=256)
    assert info.value.param == "max_model_len"


def test_the_stretched_context_generates_as_transformers_does(short_llama, tmp_path):
    """A 150-token prompt (past the checkpoint's 64 positions), chunked, then 24 greedy
    tokens: the same as transformers with the scaling in config.json."""
    engine = LLMEngine.from_pretrained(
        short_llama,
        device=DEVICE,
        dtype="float32",
        hf_overrides=YARN,
        max_model_len=256,
        max_num_batched_tokens=64,
    )
    assert engine.max_model_len == 256
    scaled = tmp_path / "scaled"
    shutil.copytree(short_llama, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = load_hf_config(short_llama, YARN).rope_parameters
    (scaled / "config.json").write_text(json.dumps(config))
    prompt = list(range(3, 153))
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([prompt], params)
    assert out.token_ids == hf_greedy(hf_model(scaled, DEVICE), prompt, 24)


@pytest.mark.parametrize(
    "value,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"rope_scaling": 4}, "rope_scaling must be an object"),
    ],
)
def test_malformed_overrides_are_refused_naming_the_flag(value, message):
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(hf_overrides=value)
    assert info.value.param == "hf_overrides" and message in info.value.message
