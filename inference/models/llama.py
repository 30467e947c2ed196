"""Dense Llama (LlamaForCausalLM, and Llama-architecture models such as SmolLM2): every layer a
SwiGLU MLP; the shared decoder (decoder.py) with no experts."""

from __future__ import annotations

from inference.errors import ModelLoadError
from inference.models.args import Family
from inference.models.decoder import ATTENTION_WEIGHTS, DENSE_MLP_WEIGHTS, NORM_WEIGHTS, Decoder


def fields(cfg) -> dict:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"LlamaForCausalLM: hidden_act {cfg.hidden_act!r} is not supported (silu)"
        )
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_experts": 0,
        "top_k": 0,
        "moe_intermediate_size": 0,
        "norm_topk_prob": False,
        "dense_layers": tuple(range(cfg.num_hidden_layers)),
        "dense_intermediate_size": cfg.intermediate_size,
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "qkv_bias": bias,
        "o_bias": bias,
    }


LLAMA = Family(
    "LlamaForCausalLM", fields, NORM_WEIGHTS + ATTENTION_WEIGHTS + DENSE_MLP_WEIGHTS, Decoder
)
