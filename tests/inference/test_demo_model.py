"""The demo checkpoint loads in transformers, is deterministic and has the promised size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference import demo_model
from inference.demo_model import ARCHS, PRESETS, ensure_demo_model, write_demo_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {a: write_demo_model(tmp_path_factory.mktemp(a), "tiny", seed=0, arch=a) for a in ARCHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_loads_in_transformers(tiny_dirs, arch):
    path = tiny_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    p = PRESETS["tiny"]
    assert model.config.vocab_size == len(tok) == p.vocab_size
    assert model.dtype == torch.float32
    ids = torch.randint(3, p.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new = out[0, 8:].tolist()
    assert len(new) == 32 and len(set(new)) >= 8, new  # greedy output is not one token repeated


def test_same_seed_same_bytes(tmp_path, tiny_dirs):
    other = write_demo_model(tmp_path / "again", "tiny", seed=0, arch="mixtral")
    for f in sorted(p.name for p in tiny_dirs["mixtral"].iterdir()):
        assert (other / f).read_bytes() == (tiny_dirs["mixtral"] / f).read_bytes(), f
    seed1 = write_demo_model(tmp_path / "seed1", "tiny", seed=1, arch="mixtral")
    assert (seed1 / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tokenizer_round_trip_and_specials(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["mixtral"])
    for text in ["héllo 世界", "def f(x):\n    return x  # ok\n", "  two spaces", "emoji 🙂!"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1


def test_chat_template_and_generation_config(tiny_dirs):
    path = tiny_dirs["qwen2_moe"]
    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.generation_config.eos_token_id == [2, 0]
    assert model.config.eos_token_id == model.config.pad_token_id == 0


def test_small_preset_size():
    p = PRESETS["small"]
    config = ARCHS["mixtral"](p, {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(t.numel() for t in model.parameters())
    assert 100e6 <= n <= 125e6, n
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (6, 512, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert (config.num_local_experts, config.num_experts_per_tok) == (8, 2)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        1024,
        32000,
        4096,
    )
    assert config.rope_parameters["rope_theta"] == 1e6 and not config.tie_word_embeddings
    assert p.dtype == torch.bfloat16


def test_ensure_demo_model_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model("tiny", seed=3, arch="mixtral")
    assert path == demo_model.default_model_dir("tiny", 3, "mixtral")
    assert path.is_relative_to(tmp_path) and (path / "model.safetensors").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model("tiny", seed=3, arch="mixtral") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left


def test_unknown_preset_or_arch(tmp_path):
    with pytest.raises(ValueError):
        write_demo_model(tmp_path, "huge")
    with pytest.raises(ValueError):
        write_demo_model(tmp_path, arch="llama")
