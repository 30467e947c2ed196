"""Configuration: the model's shape read from a Hugging Face config, and the engine's limits.

Each component copies the scalars it needs at construction (nano-vllm style); nothing
reads a config deep inside the hot path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from inference.errors import InvalidParameterError, ModelLoadError

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(slots=True)
class ModelArgs:
    """Architecture-independent description of an MoE decoder, derived from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_intermediate_size: int = 0  # MLP width of layers that are dense (not MoE)
    dense_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    hf_config: object = field(default=None, repr=False)  # for rope initialisation

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        common = dict(
            architecture=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
            top_k=cfg.num_experts_per_tok, rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), hf_config=cfg)
        if arch == "MixtralForCausalLM":
            return cls(**common, num_experts=cfg.num_local_experts,
                       moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True)
        # Qwen2MoeForCausalLM: shared expert, optional dense layers, q/k/v bias.
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        only_mlp = set(getattr(cfg, "mlp_only_layers", []) or [])
        dense = tuple(i for i in range(cfg.num_hidden_layers)
                      if i in only_mlp or cfg.num_experts == 0 or (i + 1) % step != 0)
        return cls(**common, num_experts=cfg.num_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   norm_topk_prob=bool(cfg.norm_topk_prob), qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   dense_intermediate_size=cfg.intermediate_size, dense_layers=dense)


@dataclass(slots=True)
class EngineConfig:
    """The limits of SPEC section 3 (same names as the CLI flags)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, kv cache)
    kv_cache_tokens: int | None = None  # CPU default 65536; GPU: sized from free memory
    max_waiting: int = 256
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be >= 1")
        for name in ("max_model_len", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameterError(name, "must be >= 1")

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
