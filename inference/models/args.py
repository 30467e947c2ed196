"""What the model files share about a checkpoint: ModelArgs, the architecture-independent shape
of a decoder read from its config.json, and Family, what one architecture adds to it (how to
read its config and weights, which module to build, its demo checkpoint). models/registry.py
maps each supported `architectures` name to its Family.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from inference.errors import ModelLoadError


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
    max_position_embeddings: int  # the longest context (context_length: with its RoPE scaling)
    qkv_bias: bool = False  # MLA: bias of q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False
    qk_norm: str = ""  # "head": RMSNorm per head (Qwen3-MoE); "full": whole q/k projection (OLMoE)
    clip_qkv: float | None = None
    sliding_window: int = 0  # > 0: the layers in sliding_layers attend to this many positions
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)
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
    router_bias: bool = False  # the router and every expert projection have biases (gpt-oss)
    expert_bias: bool = False
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU (moe.ClampedSwiGLU) in the experts
    swiglu_alpha: float = 1.0
    q_lora_rank: int = 0  # MLA (DeepSeek-V2) from here on; kv_lora_rank 0: standard attention
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # partial rotary (GLM-4.5, MiniMax-M2): only the first rotary_dim dims of each q/k head
    # rotate (rotate-half within them), the rest pass; 0: the whole head
    rotary_dim: int = 0
    tie_word_embeddings: bool = False
    # speculative method "mtp": the model also builds the checkpoint's first MTP layer
    # (models/mtp.py, layer num_layers), and the KV cache holds one more layer for it
    mtp: bool = False
    # its own shared_head.head; without it (GLM-4.6's checkpoints) it reads the target's lm_head,
    # as vLLM shares it
    mtp_own_head: bool = True
    hf_config: object = field(default=None, repr=False)  # for rope initialisation

    @property
    def rope_dim(self) -> int:
        """The width of each head that rotates (the rope tables' width)."""
        return self.qk_rope_head_dim or self.rotary_dim or self.head_dim

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


def common_fields(cfg) -> dict:
    """The ModelArgs fields every Hugging Face decoder config spells the same way."""
    return {
        "architecture": cfg.architectures[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "top_k": getattr(cfg, "num_experts_per_tok", 0),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": context_length(cfg),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "hf_config": cfg,
    }


def context_length(cfg) -> int:
    """The longest context the config allows, as vLLM derives it: max_position_embeddings,
    stretched by a RoPE scaling's factor (YaRN: its original_max_position_embeddings times
    the factor); llama3's and longrope's configs already name the stretched length."""
    length = cfg.max_position_embeddings
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    factor = rope.get("factor")
    if rope.get("rope_type", "default") in ("default", "llama3", "longrope") or not factor:
        return length
    if rope["rope_type"] == "yarn":
        length = rope.get("original_max_position_embeddings") or length
    return int(length * factor)


# rope scalings whose tables transformers' initialisers give once for every position; the
# others ("dynamic", "longrope", ...) change with the sequence's length: not served
SERVED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def refuse_unserved(cfg, served: dict[str, Any]) -> None:
    """Raises ModelLoadError naming the first config field (of `served`, where the config has
    it) whose value is not the one we serve."""
    for name, value in served.items():
        got = getattr(cfg, name, value)
        if got != value:
            raise ModelLoadError(
                f"{cfg.architectures[0]}: {name} {got!r} is not supported ({value!r})"
            )


def refuse_unserved_rope(cfg) -> None:
    """A rope scaling we do not serve (dynamic NTK, longrope...: their tables depend on the
    sequence) is refused for every family, naming the field."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SERVED_ROPE_TYPES:
        raise ModelLoadError(
            f"{cfg.architectures[0]}: rope_parameters.rope_type {rope_type!r} is not supported "
            f"({', '.join(SERVED_ROPE_TYPES)})"
        )


def rotary_fields(cfg, head_dim: int) -> dict:
    """Partial rotary from the config's rope_parameters (transformers moves partial_rotary_factor
    and MiniMax's rotary_dim there): the rotating width, as transformers' rope computes it."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ModelLoadError(
            f"{cfg.architectures[0]}: rope_parameters.partial_rotary_factor "
            f"{rope.get('partial_rotary_factor')!r} gives a rotary width of {rotary} of "
            f"{head_dim}: it must be even and in (0, head_dim]"
        )
    return {"rotary_dim": rotary if rotary < head_dim else 0}


@dataclass(frozen=True, slots=True)
class WeightRule:
    """Checkpoint tensor names (after "model.layers.N.") -> one of our parameters (under
    "layers.N."). `target` may use the pattern's groups ({0}, {1}) and {moe}, the routed
    experts' module ("mlp." or, beside shared experts, "mlp.moe."); a pattern's first group,
    when it is a number, is the expert index. `part`: None (the whole tensor), or which rows
    of a fused parameter it fills ("q", "k", "v", "gate", "up", or a group such as "{0}").
    `convert`: the checkpoint tensor -> our layout, where they differ (gpt-oss's transposed,
    interleaved experts)."""

    pattern: re.Pattern
    target: str
    part: str | None = None
    convert: Callable[[Any], Any] | None = None


def rules(*specs: tuple) -> tuple[WeightRule, ...]:
    """WeightRules from (pattern, target, part[, convert]) tuples."""
    return tuple(WeightRule(re.compile(p), *rest) for p, *rest in specs)


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture (config.json's `architectures[0]`):
    - fields: its config -> the ModelArgs fields past common_fields (raising ModelLoadError for
      a variant we do not serve);
    - weights: its checkpoint's per-layer tensor names -> our parameters, first match wins;
    - model: the nn.Module built as model(args, max_positions, gather_max_tokens);
    - demo: the --arch name of its random-weight demo checkpoint and the transformers config
      it writes (demo(preset, common) -> PretrainedConfig; checkpoints/demo_model.py), if any;
    - mtp_layers: its checkpoints may carry multi-token-prediction layers after the last
      decoder layer (model.layers.N and up): loaded past, unless the speculative method
      "mtp" runs the first of them (ModelArgs.mtp);
    - demo_shapes: preset name -> the Preset fields its demo changes there to take the
      family's own shape (the `small` preset: DeepSeek-V3 routing 8 of 256 experts...).
    """

    architecture: str
    fields: Callable[[Any], dict]
    weights: tuple[WeightRule, ...]
    model: type[nn.Module]
    demo: tuple[str, Callable[[Any, dict], Any]] | None = None
    mtp_layers: bool = False
    demo_shapes: dict[str, dict] = field(default_factory=dict)
