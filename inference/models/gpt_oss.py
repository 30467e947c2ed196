"""gpt-oss (GptOssForCausalLM): the shared decoder with learned attention sinks in every layer,
sliding-window layers alternating with full ones, YaRN, biases on the attention projections,
the router and every expert projection, and the experts' clamped SwiGLU (moe.ClampedSwiGLU).
Its router takes the top-k logits and softmaxes them among themselves, which is MoE's softmax
router renormalised over the top-k.

Checkpoints store each layer's experts transposed with gate and up interleaved
(gate_up_proj [E, D, 2I], column 2i gate, 2i+1 up; down_proj [E, I, D]); published ones in
MXFP4 (`*_blocks`, `*_scales`), which the loader dequantizes at load (executor/loader.py)."""

from __future__ import annotations

import torch
from transformers import GptOssConfig

from inference.errors import ModelLoadError
from inference.models.args import Family, rules
from inference.models.decoder import ATTENTION_WEIGHTS, NORM_WEIGHTS, Decoder

_LAYER_TYPES = ("sliding_attention", "full_attention")


def fields(cfg) -> dict:
    """The config -> ModelArgs fields past the common ones; a layer type we do not serve is
    refused, naming its field."""
    layer_types = list(cfg.layer_types or [])
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown or len(layer_types) != cfg.num_hidden_layers:
        raise ModelLoadError(
            f"GptOssForCausalLM: layer_types must give one of {', '.join(_LAYER_TYPES)} per "
            f"layer, got {layer_types!r}"
        )
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if sliding and not (cfg.sliding_window or 0) > 0:
        raise ModelLoadError("GptOssForCausalLM: sliding_window must be positive")
    if not cfg.swiglu_limit > 0:
        raise ModelLoadError(f"GptOssForCausalLM: swiglu_limit {cfg.swiglu_limit} must be > 0")
    bias = bool(cfg.attention_bias)
    return {
        "num_experts": cfg.num_local_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": True,  # softmax over the top-k logits
        "qkv_bias": bias,
        "o_bias": bias,
        "sliding_window": (cfg.sliding_window or 0) if sliding else 0,
        "sliding_layers": sliding,
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
        "swiglu_limit": float(cfg.swiglu_limit),
        "swiglu_alpha": float(cfg.swiglu_alpha),
    }


def _gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """Rows (the second dimension) interleaved gate, up, gate, ... -> all gates, then all ups."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


WEIGHTS = (
    NORM_WEIGHTS
    + ATTENTION_WEIGHTS
    + rules(
        (r"self_attn\.sinks", "attn.attn.sinks", None),
        (r"mlp\.router\.(weight|bias)", "mlp.gate.{0}", None),
        (
            r"mlp\.experts\.gate_up_proj",
            "mlp.experts.w13",
            None,
            lambda w: _gate_then_up(w.transpose(1, 2)),
        ),
        (r"mlp\.experts\.gate_up_proj_bias", "mlp.experts.b13", None, _gate_then_up),
        (r"mlp\.experts\.down_proj", "mlp.experts.w2", None, lambda w: w.transpose(1, 2)),
        (r"mlp\.experts\.down_proj_bias", "mlp.experts.b2", None),
    )
)


def demo_config(p, common: dict) -> GptOssConfig:
    """gpt-oss's layout at the preset's size: sinks, sliding layers alternating with full ones
    (a window of a quarter of the hidden size: 16 tokens at tiny, so that short tests slide
    it, and gpt-oss's own 128 at small), YaRN over a context a 32nd as long, biases."""
    original = max(p.max_positions // 32, 64)
    return GptOssConfig(
        **common
        | {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": p.max_positions / original,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": original,
            }
        },
        head_dim=p.head_dim,
        intermediate_size=p.ffn,
        num_local_experts=p.num_experts,
        sliding_window=max(p.hidden // 4, 8),
        attention_bias=True,
    )


GPT_OSS = Family(
    "GptOssForCausalLM",
    fields,
    WEIGHTS,
    Decoder,
    ("gpt_oss", demo_config),
    # gpt-oss-20b's routing: 4 of 32 experts as wide as the hidden size
    demo_shapes={"small": {"num_experts": 32, "top_k": 4, "ffn": 512}},
)
