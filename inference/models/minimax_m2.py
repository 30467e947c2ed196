"""MiniMax-M2 (MiniMaxM2ForCausalLM): standard attention with RMSNorm over the whole q and k
projections (all heads at once), partial rotary (the first rotary_dim dims of each head), and
sigmoid routing with a correction bias over many small experts (moe.NoAuxMoE with one group:
top-k on the biased scores, weights from the unbiased ones, renormalised), Mixtral's checkpoint
names. Its checkpoints' multi-token-prediction modules load and are not run."""

from __future__ import annotations

from transformers import MiniMaxM2Config

from inference.errors import ModelLoadError
from inference.models.args import Family, refuse_unserved, rotary_fields, rules
from inference.models.decoder import Decoder, DecoderLayer
from inference.models.mixtral import WEIGHTS as MIXTRAL_WEIGHTS
from inference.models.moe import NoAuxMoE


class MiniMaxM2Layer(DecoderLayer):
    moe_class = NoAuxMoE


class MiniMaxM2(Decoder):
    layer_class = MiniMaxM2Layer


def fields(cfg) -> dict:
    """The config -> ModelArgs fields; a variant we do not serve (another scoring function, no
    routing bias, per-head q/k norms, shared experts, linear-attention layers) is refused,
    naming its field."""
    refuse_unserved(
        cfg,
        {
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "shared_intermediate_size": 0,
            "hidden_act": "silu",
        },
    )
    attn_types = getattr(cfg, "attn_type_list", None) or []
    if any(t != 1 for t in attn_types):  # 0: MiniMax-01's lightning (linear) attention
        raise ModelLoadError(
            f"{cfg.architectures[0]}: attn_type_list {attn_types} has layers other than full "
            "softmax attention (1), which are not supported"
        )
    return rotary_fields(cfg, cfg.head_dim) | {
        "num_experts": cfg.num_local_experts,
        "moe_intermediate_size": cfg.intermediate_size,
        "norm_topk_prob": True,
        "qk_norm": "full",
        "topk_method": "noaux_tc",
        "router_fp32": True,
    }


WEIGHTS = (
    rules(
        (
            r"block_sparse_moe\.e_score_correction_bias",
            "{moe}gate.e_score_correction_bias",
            None,
        )
    )
    + MIXTRAL_WEIGHTS
)


def demo_config(p, common: dict) -> MiniMaxM2Config:
    """MiniMax-M2's layout at the preset's size: four times the preset's experts at a quarter of
    its width, twice its top-k (many small experts), half of each head rotating."""
    return MiniMaxM2Config(
        **(common | {"num_experts_per_tok": p.top_k * 2}),
        head_dim=p.head_dim,
        rotary_dim=p.head_dim // 2,
        intermediate_size=p.ffn // 4,
        num_local_experts=p.num_experts * 4,
    )


MINIMAX_M2 = Family(
    "MiniMaxM2ForCausalLM",
    fields,
    WEIGHTS,
    MiniMaxM2,
    ("minimax_m2", demo_config),
    mtp_layers=True,
    # with demo_config's x4 experts at a quarter width and top-k doubled: MiniMax-M2's 8 of
    # 256 experts, each a quarter of the hidden width
    demo_shapes={"small": {"num_experts": 64, "top_k": 4, "ffn": 512}},
)
