"""Configuration: the model's shape read from a Hugging Face config, and the engine's limits.

Each component copies the scalars it needs at construction (nano-vllm style); nothing
reads a config deep inside the hot path.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference.errors import InvalidParameterError, ModelLoadError


@dataclass(slots=True)
class ModelArgs:
    """Architecture-independent description of a decoder, derived from config.json: MoE, or
    dense (num_experts 0, every layer in dense_layers)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head width (MLA: nope + rope part)
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool = False  # MLA: bias of q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False
    qk_norm: str = ""  # "head": RMSNorm per head (Qwen3-MoE); "full": whole q/k projection (OLMoE)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = True  # Qwen2-MoE scales it by a sigmoid gate; DeepSeek does not
    dense_intermediate_size: int = 0  # MLP width of layers that are dense (not MoE)
    mlp_bias: bool = False  # dense MLP projections have biases (Llama mlp_bias)
    dense_layers: tuple[int, ...] = ()
    topk_method: str = "greedy"  # or "group_limited_greedy" (DeepSeek-V2)
    num_groups: int = 1  # > 1 only for group-limited routing
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False  # DeepSeek-V2 routes in float32 whatever the model dtype
    q_lora_rank: int = 0  # MLA (DeepSeek-V2) from here on; kv_lora_rank 0: standard attention
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tie_word_embeddings: bool = False
    hf_config: object = field(default=None, repr=False)  # for rope initialisation

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim or self.head_dim

    @property
    def num_moe_layers(self) -> int:
        """Layers that route tokens to experts (the rows of StepStats.expert_tokens)."""
        return self.num_layers - len(self.dense_layers) if self.num_experts else 0

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per layer, the [heads, width] of each paged cache tensor (one row per token slot):
        key and value, or for MLA one compressed latent plus the shared rope key."""
        if self.kv_lora_rank:
            return ((1, self.kv_lora_rank + self.qk_rope_head_dim),)
        return ((self.num_kv_heads, self.head_dim),) * 2

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        if arch not in _ARCH_FIELDS:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        common = {
            "architecture": arch,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim,
            "top_k": getattr(cfg, "num_experts_per_tok", 0),
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "hf_config": cfg,
        }
        return cls(**(common | _ARCH_FIELDS[arch](cfg)))


def _mixtral(cfg) -> dict:
    return {
        "num_experts": cfg.num_local_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": True,
    }


def _qwen_moe(cfg) -> dict:
    """Qwen2-MoE (shared expert, q/k/v bias) and Qwen3-MoE (per-head q/k norms): both have
    optional dense layers (decoder_sparse_step, mlp_only_layers)."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(cfg, "mlp_only_layers", []) or [])
    dense = tuple(
        i
        for i in range(cfg.num_hidden_layers)
        if i in only_mlp or cfg.num_experts == 0 or (i + 1) % step != 0
    )
    out = {
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "dense_layers": dense,
        "dense_intermediate_size": cfg.intermediate_size,
    }
    if cfg.architectures[0] == "Qwen3MoeForCausalLM":
        bias = bool(getattr(cfg, "attention_bias", False))
        return out | {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias}
    return out | {
        "qkv_bias": bool(getattr(cfg, "qkv_bias", True)),
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }


def _olmoe(cfg) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "qk_norm": "full",
        "clip_qkv": cfg.clip_qkv,
        "qkv_bias": bias,
        "o_bias": bias,
    }


def _deepseek_v2(cfg) -> dict:
    """Multi-head latent attention, shared experts (ungated), the first k layers (and, as in
    DeepSeek's own code, layers off moe_layer_freq) dense, greedy or group-limited routing."""
    method = cfg.topk_method or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(
            f"DeepseekV2ForCausalLM: topk_method {method!r} is not supported "
            "(greedy, group_limited_greedy)"
        )
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    dense = tuple(
        i for i in range(cfg.num_hidden_layers) if i < cfg.first_k_dense_replace or i % freq
    )
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_kv_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "num_experts": cfg.n_routed_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "qkv_bias": bias,
        "o_bias": bias,
        "shared_expert_intermediate_size": (cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
        "shared_expert_gated": False,
        "dense_intermediate_size": cfg.intermediate_size,
        "dense_layers": dense,
        "topk_method": method,
        "num_groups": (cfg.n_group or 1) if method == "group_limited_greedy" else 1,
        "topk_group": cfg.topk_group or 1,
        "routed_scaling_factor": float(cfg.routed_scaling_factor),
        "router_fp32": True,
        "q_lora_rank": cfg.q_lora_rank or 0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
    }


def _llama(cfg) -> dict:
    """Dense Llama (and Llama-architecture models such as SmolLM2): every layer a SwiGLU MLP."""
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


_ARCH_FIELDS = {
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen_moe,
    "Qwen3MoeForCausalLM": _qwen_moe,
    "OlmoeForCausalLM": _olmoe,
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "LlamaForCausalLM": _llama,
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_FIELDS)


QUANTIZATIONS = ("none", "int8", "fp8")  # weights (quant.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # the paged cache (kv_cache.py)


@dataclass(slots=True)
class EngineConfig:
    """The limits of SPEC section 3 (same names as the CLI flags)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, kv cache)
    kv_cache_tokens: int | None = None  # CPU default 65536; GPU: sized from free memory
    kv_cache_bytes: int | None = None  # the same budget in bytes (instead of tokens)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8, fp8_e4m3, fp8_e5m2
    quantization: str | None = None  # weights: none, int8, fp8; None: as the checkpoint ships
    max_waiting: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # torch.compile the decode steps (pure decode batches; prefill steps stay eager). Compiles
    # at start-up (warm-up generations), so the first request does not pay for it.
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        for name in ("max_model_len", "kv_cache_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameterError(name, "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise InvalidParameterError(
                "kv_cache_bytes", "sizes the same cache as kv_cache_tokens: set one of them"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(
                "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidParameterError(
                "quantization", f"must be one of {', '.join(QUANTIZATIONS)}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", "is cuda but no CUDA device is available")
    if device not in ("cpu", "cuda"):
        raise InvalidParameterError("device", "must be auto, cpu or cuda")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU the checkpoint's own dtype (float16 runs as bfloat16
    there, since CPU float16 matmuls are slow)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise InvalidParameterError("dtype", "must be auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    chosen = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    return torch.bfloat16 if chosen == torch.float16 else chosen


def cache_root() -> Path:
    """Where moeserve keeps what it builds or fetches once: demo checkpoints, tokenizers,
    wheels, compiled kernels (MOESERVE_CACHE_DIR, else ~/.cache/moeserve)."""
    return Path(os.environ.get("MOESERVE_CACHE_DIR") or Path.home() / ".cache" / "moeserve")
