"""GGUF import: a llama.cpp checkpoint file turned into a Hugging Face checkpoint folder.

`import_gguf(gguf_path, out_dir)` reads the file through transformers' own GGUF support
(which uses the `gguf` package to parse and dequantise), then writes config.json,
generation_config.json, model.safetensors and the tokenizer (tokenizer.json and
tokenizer_config.json carrying the GGUF's chat template) with `save_pretrained`, so both
this engine and transformers load the result. No hand-written GGUF parser.

Weights are written in bfloat16. Quantised GGUF tensors (Q4_1, Q8_0, ...) have no
torch dtype of their own: they dequantise to float32, which would double the file for
no gain, since bfloat16 rounding (relative 2^-9) is far below a 4-bit quantisation
step (~1/15 of a block's range). Float32 tensors in the GGUF (norm weights) go to
bfloat16 too, as in the original bfloat16 releases of the models GGUF files come from.
The output folder appears atomically (written under a temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from inference.errors import ModelLoadError

SAVE_DTYPE = torch.bfloat16
_MARKER = "moeserve_gguf.json"  # records the source file; written last


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantise the GGUF file at `gguf_path` into a Hugging Face folder at `out_dir`.

    `out_dir` must not exist yet, or be empty; it is created atomically.
    """
    src = Path(gguf_path).resolve()
    out = Path(out_dir).resolve()
    if not src.is_file():
        raise ModelLoadError(f"GGUF file {src} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"{out} already exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(src, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(src: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5 can keep GGUF blocks packed (with the `kernels` package): unpack
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4.x always dequantises GGUF weights
        pass
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=SAVE_DTYPE, **kwargs
        )
    except (ImportError, ValueError, KeyError, OSError) as e:
        # Unsupported GGUF architecture or quantisation type, a corrupt file, or a
        # missing `gguf`/`accelerate` package: transformers says which.
        raise ModelLoadError(f"cannot import GGUF file {src}: {e}") from e
    # The model is now plain dequantised weights: drop the GGUF "quantizer" so the
    # saved config is an ordinary checkpoint, not one that claims to need the GGUF file.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.dtype = SAVE_DTYPE
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    (out / _MARKER).write_text(json.dumps({"source": src.name, "size": src.stat().st_size}) + "\n")


def _save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # As for the demo model: keep the chat template inside tokenizer_config.json (v5
    # writes a separate chat_template.jinja) and name the generic fast class, which
    # transformers 4.x can load (v5 writes "TokenizersBackend").
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
