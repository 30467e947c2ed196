"""The tool-call family a checkpoint's outputs follow, where --tool-call-parser is "auto"."""

from __future__ import annotations

from service.parsers.tool_calls.deepseek import DS_CALL_BEGIN, DS_CALLS_BEGIN
from service.parsers.tool_calls.glm45 import GLM_KEY
from service.parsers.tool_calls.hermes import HERMES_OPEN
from service.parsers.tool_calls.kimi_k2 import KIMI_SECTION_BEGIN
from service.parsers.tool_calls.llama3_json import LLAMA_PYTHON_TAG
from service.parsers.tool_calls.minimax_m2 import MINIMAX_OPEN
from service.parsers.tool_calls.mistral import MISTRAL_CALLS

# By architecture where its chat template names no tool-call syntax (templates are checked
# first: a ChatML demo Mixtral speaks hermes).
_ARCH_PARSERS = {
    "MixtralForCausalLM": "mistral",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm45",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "openai",
    "LlamaForCausalLM": "llama3_json",
}


def parser_for(architecture: str, chat_template: str | None) -> str:
    """The default tool-call parser for a checkpoint of `architecture` (its config's
    `architectures[0]`) with `chat_template`; "hermes" where nothing says otherwise (OLMoE's
    templates have no tool syntax)."""
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if KIMI_SECTION_BEGIN[0] in template:  # Kimi-K2 (a DeepseekV3ForCausalLM)
        return "kimi_k2"
    if DS_CALLS_BEGIN in template or DS_CALL_BEGIN in template:
        # V3.1's template writes NAME<sep>ARGS; V2.5's, V3's and R1's a ```json fence
        return "deepseek" if "```json" in template else "deepseek_v31"
    if MINIMAX_OPEN in template:
        return "minimax_m2"
    if GLM_KEY in template:  # GLM-4.5's calls open with <tool_call> too: before hermes
        return "glm45"
    if LLAMA_PYTHON_TAG in template:
        return "llama3_json"
    if HERMES_OPEN in template:  # Llama-architecture ChatML models (SmolLM2) list calls
        return "llama3_json" if architecture == "LlamaForCausalLM" else "hermes"
    return _ARCH_PARSERS.get(architecture, "hermes")
