"""The demo checkpoint loads in transformers, is deterministic and has the promised size."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.checkpoints import demo_model
from inference.checkpoints.demo_model import (
    ARCHS,
    CHAT_TEMPLATE,
    PRESETS,
    ensure_demo_model,
    write_demo_model,
)
from inference.models.registry import model_args as model_args_of
from service.parsers.tool_calls import parse_tool_calls, parser_for


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {a: write_demo_model(tmp_path_factory.mktemp(a), "tiny", seed=0, arch=a) for a in ARCHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_loads_in_transformers(tiny_dirs, arch):
    path = tiny_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    p = PRESETS["tiny"]
    assert model.config.vocab_size == len(tok) == p.vocab_size
    assert model.dtype == torch.float32
    ids = torch.randint(3, p.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new = out[0, 8:].tolist()
    assert len(new) == 32 and len(set(new)) >= 8, new  # greedy output is not one token repeated


def test_same_seed_same_bytes(tmp_path, tiny_dirs):
    other = write_demo_model(tmp_path / "again", "tiny", seed=0, arch="mixtral")
    for f in sorted(p.name for p in tiny_dirs["mixtral"].iterdir()):
        assert (other / f).read_bytes() == (tiny_dirs["mixtral"] / f).read_bytes(), f
    seed1 = write_demo_model(tmp_path / "seed1", "tiny", seed=1, arch="mixtral")
    assert (seed1 / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tokenizer_round_trip_and_specials(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["mixtral"])
    for text in ["héllo 世界", "def f(x):\n    return x  # ok\n", "  two spaces", "emoji 🙂!"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1


def test_chat_template_and_generation_config(tiny_dirs):
    path = tiny_dirs["qwen2_moe"]
    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.generation_config.eos_token_id == [2, 0]
    assert model.config.eos_token_id == model.config.pad_token_id == 0


def test_small_preset_size():
    p = PRESETS["small"]
    config = ARCHS["mixtral"](p, {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(t.numel() for t in model.parameters())
    assert 100e6 <= n <= 125e6, n
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (6, 512, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert (config.num_local_experts, config.num_experts_per_tok) == (8, 2)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        1024,
        32000,
        32768,
    )
    assert config.rope_parameters["rope_theta"] == 1e6 and not config.tie_word_embeddings
    assert p.dtype == torch.bfloat16


def test_medium_preset_size():
    """`medium` (issue 40): 1-2 GB of bf16 weights, many times a last-level cache, of which a
    token reads a few hundred MB; 32K positions like the others. Counted on the meta device,
    nothing materialized."""
    p = PRESETS["medium"]
    config = ARCHS["mixtral"](p, {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())
    n = sum(t.numel() for t in params.values())
    assert 1e9 <= 2 * n <= 2e9, n  # bf16 bytes
    experts = sum(t.numel() for k, t in params.items() if ".experts." in k)
    embed = model.get_input_embeddings().weight.numel()
    active = n - embed - experts + experts * p.top_k // p.num_experts
    assert 250e6 <= 2 * active <= 400e6, active  # a token's reads: ~10x a 32 MB L3
    assert (config.num_local_experts, config.num_experts_per_tok) == (16, 2)
    assert config.max_position_embeddings == 32768 and p.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "arch,experts,top_k,width",
    [
        ("deepseek_v3", 256, 8, 128),  # DeepSeek-V3 / Kimi-K2: 8 of 256 small experts
        ("gpt_oss", 32, 4, 512),  # gpt-oss-20b: 4 of 32, as wide as the hidden size
        ("glm4_moe", 128, 8, 192),  # GLM-4.5-Air: 8 of 128
        ("minimax_m2", 256, 8, 128),  # MiniMax-M2: 8 of 256
    ],
)
def test_the_small_preset_takes_each_new_familys_routing_shape(arch, experts, top_k, width):
    """`--preset small` of the families whose routing sets them apart writes their own shape
    (Family.demo_shapes); the tiny preset the tests use keeps the shared one."""
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    small = ARCHS[arch](demo_model.family_preset("small", arch), ids)
    small.architectures = [type(small).__name__.replace("Config", "ForCausalLM")]
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(small)  # transformers builds the shape
    args = model_args_of(small)
    assert (args.num_experts, args.top_k, args.moe_intermediate_size) == (experts, top_k, width)
    assert demo_model.family_preset("tiny", arch) == PRESETS["tiny"]
    assert demo_model._marker("small", 0, arch)["shape"]  # a changed shape is a new checkpoint


def test_ensure_demo_model_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model("tiny", seed=3, arch="mixtral")
    assert path == demo_model.default_model_dir("tiny", 3, "mixtral")
    assert path.is_relative_to(tmp_path) and (path / "model.safetensors").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model("tiny", seed=3, arch="mixtral") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left


def test_unknown_preset_or_arch(tmp_path):
    with pytest.raises(ValueError):
        write_demo_model(tmp_path, "huge")
    with pytest.raises(ValueError):
        write_demo_model(tmp_path, arch="llama")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_chat_template_renders_tools_as_qwen_does(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3_moe"])
    user = {"role": "user", "content": "Weather in Paris?"}
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, user],
        tools=[WEATHER_TOOL],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK + "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    # no system message: the tools are the whole system turn
    assert tok.apply_chat_template([user], tools=[WEATHER_TOOL], tokenize=False) == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    )
    # tools=[] is a plain chat
    assert tok.apply_chat_template([user], tools=[], tokenize=False) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    )


def test_chat_template_renders_tool_calls_and_results(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["deepseek_v2"])
    messages = [
        {"role": "user", "content": "Paris and Lyon?"},
        {  # OpenAI's shape: arguments as a JSON string, content null
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {  # arguments as a dict (transformers' own examples)
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "20 C"}]},
        {"role": "assistant", "content": "Paris 18 C, Lyon 20 C."},
        {"role": "user", "content": "And Nice?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "22 C"},
    ]
    text = tok.apply_chat_template(
        messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nParis and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n20 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18 C, Lyon 20 C.<|im_end|>\n"
        "<|im_start|>user\nAnd Nice?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_demo_checkpoints_parse_their_own_tool_calls(tiny_dirs, arch):
    """Every demo architecture gets the template, its default parser is hermes, and the
    assistant turn the template renders parses back into the same calls."""
    path = tiny_dirs[arch]
    config = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == CHAT_TEMPLATE
    parser = parser_for(config["architectures"][0], tok.chat_template)
    assert parser == "hermes"
    args = {"city": "Zürich", "note": 'a "quoted" } brace'}
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}},
        {"type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    prompt = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(prompt, tools=[WEATHER_TOOL], tokenize=False)
    text = tok.apply_chat_template(
        [*prompt, {"role": "assistant", "content": "Sure.", "tool_calls": calls}],
        tools=[WEATHER_TOOL],
        tokenize=False,
    )
    turn = text.removeprefix(before).removeprefix("<|im_start|>assistant\n")
    content, parsed = parse_tool_calls(parser, turn.removesuffix("<|im_end|>\n"))
    assert content == "Sure.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", args),
        ("now", {}),
    ]
