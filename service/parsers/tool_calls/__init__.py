"""Tool calls in a model's own syntax: one parser per model family, whole text or streamed.

`parse_tool_calls(parser, text)` splits a finished completion into content and calls;
`ToolCallStream(parser)` does the same over the deltas of a streamed one (`feed` per delta,
`finish` at the end). The whole-text parse is the stream fed the text at once, and the
stream decides nothing before the text it has seen settles it, so any chunking of a text
gives the same content and the same calls.

Families (`PARSERS`, one module each; `parser_for` picks one from a checkpoint): "hermes"
(hermes.py), "mistral" (mistral.py), "deepseek" (deepseek.py), "llama3_json"
(llama3_json.py), "deepseek_v31" (deepseek_v31.py), "kimi_k2" (kimi_k2.py), "glm45"
(glm45.py), "minimax_m2" (minimax_m2.py).

Rules common to all families:
  - a call is a JSON object with a non-empty string "name" and an object of arguments
    ("arguments", or "parameters" where the family uses it; an object encoded as a JSON
    string is accepted); other members (such as Mistral's "id") are ignored. `arguments` is
    the arguments object's JSON text as the model wrote it. A call is emitted only once it
    is complete, so a streamed call is one delta carrying its id, name and whole arguments:
    nothing is sent that a later character could prove not to be a call.
  - text that starts like a call but does not parse stays content, byte for byte; parsing
    starts again right after the marker, so a later well-formed call is still found.
  - a missing closing marker at the very end of the text (the output stopped there) is
    accepted once the arguments object is complete (for GLM-4.5 and MiniMax-M2, whose
    arguments are tags, once an argument is).
  - content is the text outside the calls, verbatim, except that whitespace-only stretches
    between, before or after calls are dropped; text with no call comes back unchanged.
  - ids are "call_" + 24 random letters and digits (as OpenAI's), except for Mistral, whose
    chat templates and mistral-common require 9 letters and digits (as vLLM's mistral parser),
    and Kimi-K2, whose calls carry the model's own `functions.NAME:IDX` (as vLLM's kimi_k2).
  - GLM-4.5 and MiniMax-M2 write argument values as text: `ToolCallStream(parser, tools)`
    types them by the request's tools' JSON schemas, each family by vLLM's rule for it
    (typed_values.py); their arguments are the resulting object's JSON text.

The markers of Mistral (`[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`) and Llama (`<|python_tag|>`)
are special tokens: the text given here must be decoded with them kept.

For `tool_choice` "required" or a named function the output is forced by a grammar instead:
`forced_calls_schema(tools, name)` is the JSON schema it must match (as vLLM forces it) and
`forced_calls(text, name)` reads such output into calls.
"""

from service.parsers.tool_calls.calls import ToolCall, ToolCallDelta
from service.parsers.tool_calls.default_parser import parser_for
from service.parsers.tool_calls.forced import forced_calls, forced_calls_schema
from service.parsers.tool_calls.ids import new_call_id
from service.parsers.tool_calls.registry import PARSERS
from service.parsers.tool_calls.stream import ToolCallStream, parse_tool_calls

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "forced_calls",
    "forced_calls_schema",
    "new_call_id",
    "parse_tool_calls",
    "parser_for",
]
