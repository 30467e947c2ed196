"""Run llama.cpp's `convert_hf_to_gguf.py` (vendored in the llama-cpp-python sdist) on a moeserve
demo checkpoint. Runs in the llamacpp peer venv:

    python convert_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype bf16 --outfile OUT.gguf

The demo tokenizer is a byte-level BPE trained here (a ByteLevel pre-tokenizer with GPT-2's
regex, no byte fallback), so the converter's llama path rejects it (no byte fallback) and its
GPT-2 path does not find its hash in the table of known pre-tokenizers. Its pre-tokenizer is
GPT-2's, so it is declared "gpt-2"; any other unknown tokenizer still fails as before. The
benchmark feeds token ids, so the tokenizer only serves llama-server's detokenized stream text.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    llama_dir, args = Path(sys.argv[1]), sys.argv[2:]
    model_dir = Path(args[0])
    sys.path.insert(0, str(llama_dir))
    from conversion import base  # the converter's own package; runpy below reuses this module

    pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    gpt2_style = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not gpt2_style:
                raise
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = llama_dir / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
