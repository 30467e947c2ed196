"""Demo checkpoint writer: a randomly initialised MoE model with an offline tokenizer.

`write_demo_model(out_dir, preset, seed, arch)` writes a real Hugging Face checkpoint
folder (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a ChatML chat template) that both this engine and
`transformers.AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load. Nothing is
downloaded: weights come from transformers' own initialisation under a fixed seed, and
the byte-level BPE tokenizer is trained on the Python standard library's source text.

Presets fix the dimensions (`PRESETS`); each architecture in `ARCHS` is one function
turning a preset into its transformers config, kept in the family's own file (models/). `ensure_demo_model()` writes the folder
into the cache (`default_model_dir()`) once, atomically, and returns its path; this is
what `--model demo` serves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from inference.config import cache_root
from inference.models.registry import demo_configs, demo_shapes

# Bump when the written files change, so stale cached demo models are rewritten.
FORMAT_VERSION = 3
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
_CORPUS_CHARS = 8_000_000  # enough stdlib text for a 32k vocab; trains in ~3 s on 2 cores
_MARKER = "moeserve_demo.json"
# HF's default init (std 0.02 everywhere) already gives varied greedy output, but its
# logits have std ~0.02*sqrt(hidden) (0.16 for tiny): nearly uniform, so sampling is
# noise and greedy argmax margins are tiny (fragile engine-vs-HF comparisons, worse in
# bf16). Re-drawing lm_head with std LOGIT_STD/sqrt(hidden) gives logits of std ~2
# (the final RMSNorm makes hidden states unit-scale) without changing anything else.
_LOGIT_STD = 2.0

# ChatML; with `tools` (as transformers' apply_chat_template passes them) it follows Qwen3's
# template: the tools in the system turn (after the system message, if any), assistant
# tool_calls as <tool_call> JSON blocks, tool results as <tool_response> blocks in one user
# turn per run of tool messages. What the model answers is parsed by the "hermes" parser
# (service/parsers/tool_calls/hermes.py). Chats without tools render as before.
_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_INSTRUCTIONS = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is none %}"
    "{%- else %}{{- content | map(attribute='text') | join('') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\\n\\n' }}"
    "{%- endif %}"
    '{{- "' + _TOOLS_PREAMBLE + '" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "' + _TOOLS_INSTRUCTIONS + '<|im_end|>\\n" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if text(message['content']) %}{{- '\\n' + text(message['content']) }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    num_layers: int
    hidden: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    ffn: int  # per-expert intermediate size (also the shared expert's)
    vocab_size: int
    max_positions: int
    rope_theta: float
    dtype: torch.dtype
    shared_ffn: int = 0  # Qwen2-MoE's shared expert width; 0: ffn
    # the tokenizer's vocabulary; 0: vocab_size. A smaller one leaves the ids above it
    # without text (they decode to nothing), as in Qwen's own checkpoints.
    tokenizer_vocab: int = 0


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        num_layers=2,
        hidden=64,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        num_experts=4,
        top_k=2,
        ffn=128,
        vocab_size=1024,
        max_positions=32768,  # 32K-token contexts (long-context tests and benches)
        rope_theta=1e6,
        dtype=torch.float32,
    ),
    # ~112M parameters: 6 layers, 8 heads of 64, 2 KV heads, 8 experts top-2.
    "small": Preset(
        num_layers=6,
        hidden=512,
        num_heads=8,
        head_dim=64,
        num_kv_heads=2,
        num_experts=8,
        top_k=2,
        ffn=1024,
        vocab_size=32000,
        max_positions=32768,
        rope_theta=1e6,
        dtype=torch.bfloat16,
    ),
    # ~847M parameters, 1.7 GB in bf16 (issue 40): weights many times a CPU's last-level cache,
    # so a decode step streams them from DRAM and single-stream speed shows how close an engine
    # gets to the memory-bandwidth floor. A token reads ~153M of them (attention, 2 of 16
    # experts, lm_head): ~306 MB in bf16, ten times a 32 MB L3.
    "medium": Preset(
        num_layers=10,
        hidden=1024,
        num_heads=16,
        head_dim=64,
        num_kv_heads=4,
        num_experts=16,
        top_k=2,
        ffn=1536,
        vocab_size=32000,
        max_positions=32768,
        rope_theta=1e6,
        dtype=torch.bfloat16,
    ),
}


def _common(p: Preset, ids: dict[str, int]) -> dict:
    return dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_positions,
        num_experts_per_tok=p.top_k,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        **ids,
    )


def _with_common(demo: Callable[[Preset, dict], PretrainedConfig]):
    return lambda p, ids: demo(p, _common(p, ids))


# --arch name -> (preset, special token ids) -> the family's demo config (models/<family>.py),
# for every family that has one
ARCHS: dict[str, Callable[[Preset, dict[str, int]], PretrainedConfig]] = {
    name: _with_common(demo) for name, demo in demo_configs().items()
}
SHAPES = demo_shapes()


def _corpus() -> list[str]:
    """Python stdlib sources in sorted order, up to _CORPUS_CHARS (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= _CORPUS_CHARS:
            break
    return texts


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` tokens, cached per size and corpus.

    The corpus (hence the tokenizer) is fixed by the Python installation, so the cache
    key names that instead of hashing 8 MB of text on every call.
    """
    corpus_id = f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{_CORPUS_CHARS}"
    digest = hashlib.sha256(corpus_id.encode()).hexdigest()[:16]
    path = cache_root() / "tokenizers" / f"bpe-v{FORMAT_VERSION}-{vocab_size}-{digest}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    texts = _corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(tok.to_str())
    os.replace(tmp, path)
    return tok


def _write_tokenizer(out: Path, tok: Tokenizer, max_len: int) -> None:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # Keep the template inside tokenizer_config.json (transformers 5 writes a separate
    # chat_template.jinja instead, which older loaders and other tools ignore).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # v5 writes "TokenizersBackend", which transformers 4.x cannot load.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def write_demo_model(
    out_dir: str | Path,
    preset: str | Preset = "tiny",
    seed: int = 0,
    arch: str = "mixtral",
    device: str = "cpu",
) -> Path:
    """Write a randomly initialised `arch` checkpoint of `preset` size (a name in PRESETS, or
    a Preset of one's own: bench/gpu_bench.py's Qwen1.5-MoE-A2.7B shape) into `out_dir`. The
    weights are drawn on `device` (a GPU draws billions of them in seconds)."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    p = family_preset(preset, arch) if isinstance(preset, str) else preset
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(p.tokenizer_vocab or p.vocab_size)
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    config = ARCHS[arch](p, {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot})
    config.initializer_range = 0.02
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        torch.nn.init.normal_(model.get_output_embeddings().weight, std=_LOGIT_STD / p.hidden**0.5)
    model.to(p.dtype)
    model.config.dtype = p.dtype
    model.generation_config = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=[im_end, eot],
        pad_token_id=eot,
    )
    model.save_pretrained(out)
    _write_tokenizer(out, tok, p.max_positions)
    name = preset if isinstance(preset, str) else "custom"
    marker = _marker(name, seed, arch)
    (out / _MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
    return out


def family_preset(name: str, arch: str) -> Preset:
    """Preset `name` in `arch`'s own shape where its family gives one (Family.demo_shapes)."""
    return dataclasses.replace(PRESETS[name], **SHAPES.get(arch, {}).get(name, {}))


def _marker(preset: str, seed: int, arch: str) -> dict:
    shape = SHAPES.get(arch, {}).get(preset, {})
    marker = {"version": FORMAT_VERSION, "preset": preset, "seed": seed, "arch": arch}
    return marker | ({"shape": shape} if shape else {})


def default_model_dir(preset: str = "tiny", seed: int = 0, arch: str = "mixtral") -> Path:
    """Cache location of the demo model served by `--model demo`."""
    return cache_root() / "models" / f"demo-{preset}-{arch}-s{seed}"


def ensure_demo_model(preset: str = "tiny", seed: int = 0, arch: str = "mixtral") -> Path:
    """Return the cached demo model folder, writing it first if absent or stale.

    The folder is written under a temporary name and renamed into place, so an
    interrupted write never leaves a half-written checkpoint at the final path.
    """
    target = default_model_dir(preset, seed, arch)
    want = _marker(preset, seed, arch)
    try:
        if json.loads((target / _MARKER).read_text()) == want:
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_demo_model(tmp, preset, seed, arch)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if target.exists():  # stale (older format or half-copied by hand): swap it out
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / "m")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process renamed its copy in first; use that one
            if not (target / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
