"""The architectures we serve: config.json's `architectures[0]` -> its Family (models/args.py).
Adding one: a file under models/ defining its Family (how its config and checkpoint map onto
our modules, and the modules themselves where the shared ones do not fit), an entry here, and
its parity test against transformers (README, "Adding an architecture")."""

from __future__ import annotations

from inference.errors import ModelLoadError
from inference.models.args import Family, ModelArgs, common_fields, refuse_unserved_rope
from inference.models.deepseek_v2 import DEEPSEEK_V2
from inference.models.deepseek_v3 import DEEPSEEK_V3
from inference.models.glm4_moe import GLM4_MOE
from inference.models.gpt_oss import GPT_OSS
from inference.models.llama import LLAMA
from inference.models.minimax_m2 import MINIMAX_M2
from inference.models.mixtral import MIXTRAL
from inference.models.olmoe import OLMOE
from inference.models.qwen_moe import QWEN2_MOE, QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        MIXTRAL,
        QWEN2_MOE,
        QWEN3_MOE,
        OLMOE,
        DEEPSEEK_V2,
        DEEPSEEK_V3,
        GPT_OSS,
        GLM4_MOE,
        MINIMAX_M2,
        LLAMA,
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of(hf_config) -> Family:
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return FAMILIES[arch]


def model_args(hf_config) -> ModelArgs:
    """The architecture-independent shape of a checkpoint's decoder, from its config.json."""
    family = family_of(hf_config)
    refuse_unserved_rope(hf_config)
    return ModelArgs(**(common_fields(hf_config) | family.fields(hf_config)))


def demo_configs() -> dict:
    """--arch name -> the function writing that family's demo config (checkpoints/demo_model)."""
    return {f.demo[0]: f.demo[1] for f in FAMILIES.values() if f.demo is not None}


def demo_shapes() -> dict[str, dict[str, dict]]:
    """--arch name -> preset name -> the Preset fields its demo changes (Family.demo_shapes)."""
    return {f.demo[0]: f.demo_shapes for f in FAMILIES.values() if f.demo is not None}
