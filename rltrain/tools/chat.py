"""The hand-off to chat templates: tools' schemas in the form `tokenizer.apply_chat_template(messages, tools=...)`
takes, and the messages of a tool-using turn (assistant with tool_calls, then one tool message per call), in the
OpenAI / transformers chat format that Qwen, Hermes, Llama 3 and Mistral templates render.

    text = tokenizer.apply_chat_template(messages, tools=chat_template_tools(pool.schemas.values()),
                                         tokenize=False, add_generation_prompt=True)
    messages += [assistant_message(parsed)] + [tool_message(r) for r in results]

The multi-turn loop tokenizes the tool messages itself (the model's own tokens stay as sampled); these messages are
the episode's record, for templates, logs and the reward function's extra_info.
"""

from __future__ import annotations

from collections.abc import Iterable

from rltrain.tools.base import ToolResult, validate_schema
from rltrain.tools.parsers import ParsedTurn


def chat_template_tools(schemas: Iterable[dict]) -> list[dict]:
    """[{"type": "function", "function": {name, description, parameters}}, ...] in the given order."""
    return [{"type": "function", "function": validate_schema(schema)} for schema in schemas]


def assistant_message(turn: ParsedTurn) -> dict:
    """The assistant's turn with its well-formed calls under tool_calls (malformed ones have no name/arguments to
    render; their error answers still follow as tool messages)."""
    message = {"role": "assistant", "content": turn.content}
    calls = [c for c in turn.calls if c.error is None]
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                             "arguments": c.arguments}}
                                 for c in calls]
    return message


def tool_message(result: ToolResult) -> dict:
    """{"role": "tool", "content": ...}, with the tool's name and the call's id for templates that show them."""
    message = {"role": "tool", "name": result.name, "content": result.content}
    if result.call_id:
        message["tool_call_id"] = result.call_id
    return message
