"""Test helper: a tiny random Llama checkpoint written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does it (q/k rows permuted to GGML's rope layout, byte-level BPE
vocabulary and merges in the metadata), with some tensors Q8_0-quantised."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

Q = "Q8_0"  # the quantised tensors' GGML type (row width must be a multiple of 32)


def random_llama(tokenizer_dir: Path, seed: int = 0, **overrides):
    """A random float32 LlamaForCausalLM over the tokenizer in `tokenizer_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = LlamaConfig(
        **(
            {
                "vocab_size": len(vocab),
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "bos_token_id": 0,
                "eos_token_id": 0,
                "pad_token_id": 0,
            }
            | overrides
        )
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
        # logits of std ~2 (see demo_model._LOGIT_STD): clear greedy margins
        torch.nn.init.normal_(model.lm_head.weight, std=2.0 / cfg.hidden_size**0.5)
        for name, p in model.named_parameters():  # HF zero-initialises biases: make them matter
            if name.endswith(".bias"):
                torch.nn.init.normal_(p, std=0.1)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute: HF rotate-half rows -> GGML interleaved rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model, tokenizer_dir: Path, path: Path, chat_template: str) -> dict[str, np.ndarray]:
    """Write `model` (a LlamaForCausalLM) and the tokenizer as GGUF; returns, per HF weight
    name, the float32 values the file really holds (dequantised where quantised)."""
    import gguf

    cfg = model.config
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab]
    )
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()}
    held = {}
    qtype = getattr(gguf.GGMLQuantizationType, Q)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = tensor.float().numpy()
        # Matrices quantised, norms kept in float32 (as llama.cpp does). Q8_0 blocks run along
        # rows, so quantising commutes with the q/k row permutation below.
        quantise = arr.ndim == 2
        held[hf_name] = (
            gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype) if quantise else arr
        )
        if hf_name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        if quantise:
            packed = gguf.quants.quantize(arr, qtype)
            w.add_tensor(names[hf_name], packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            w.add_tensor(names[hf_name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
