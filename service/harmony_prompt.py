"""Chat prompts for gpt-oss rendered by harmony's own renderer (openai-harmony), as vLLM renders
them, where the served tokenizer is harmony's (a gpt-oss checkpoint's: harmony's token ids are
then the model's); other tokenizers go through their chat template (service/validation.py).

OpenAI messages become harmony messages: system and developer messages the developer's
instructions (the system message is harmony's own, with the model identity and reasoning
effort), the tools the developer's `functions` namespace, an assistant's tool calls messages on
`commentary` to `functions.NAME`, a tool result a message from `functions.NAME` (the name found
from its tool_call_id) and an assistant's text the `final` channel.
"""

from __future__ import annotations

import json

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    Role,
    SystemContent,
    ToolDescription,
)

from service.errors import BadRequest
from service.parsers.harmony import harmony_encoding

# harmony's special tokens and their ids in o200k_harmony (a gpt-oss tokenizer has them)
_HARMONY_IDS = {
    "<|start|>": 200006,
    "<|channel|>": 200005,
    "<|message|>": 200008,
    "<|end|>": 200007,
}


def is_harmony_tokenizer(tokenizer) -> bool:
    """Whether the tokenizer is gpt-oss's (harmony's token ids for harmony's special tokens)."""
    try:
        ids = tokenizer.convert_tokens_to_ids(list(_HARMONY_IDS))
    except (AttributeError, KeyError, TypeError):
        return False
    return ids == list(_HARMONY_IDS.values())


def render_harmony(messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt's token ids, ending where the assistant's reply starts (`<|start|>assistant`)."""
    instructions = [m["content"] or "" for m in messages if m["role"] in ("system", "developer")]
    rendered = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new())]
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if tools:
        developer = developer.with_function_tools([_tool(t["function"]) for t in tools])
    if instructions or tools:
        rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"] or ""
        if role == "user":
            rendered.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if content:
                message = Message.from_role_and_content(Role.ASSISTANT, content)
                rendered.append(message.with_channel("final"))
            for call in m.get("tool_calls") or []:
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                names[call["id"]] = name
                text = arguments if isinstance(arguments, str) else json.dumps(arguments)
                message = Message.from_role_and_content(Role.ASSISTANT, text)
                rendered.append(
                    message.with_channel("commentary")
                    .with_recipient(f"functions.{name}")
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "") or m.get("name")
            if not name:
                raise BadRequest(
                    "a tool message needs the tool_call_id of an earlier assistant tool call",
                    param=f"messages[{i}].tool_call_id",
                )
            author = Author.new(Role.TOOL, f"functions.{name}")
            message = Message.from_author_and_content(author, content)
            rendered.append(message.with_channel("commentary").with_recipient("assistant"))
    conversation = Conversation.from_messages(rendered)
    return harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)


def _tool(function: dict) -> ToolDescription:
    return ToolDescription.new(
        function["name"], function.get("description") or "", parameters=function.get("parameters")
    )
