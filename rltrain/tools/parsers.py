"""Tool-call parsers: one per chat-template family, turning an assistant turn's text into its content and calls.

    parsed = PARSERS.get("hermes")(text)     # -> ParsedTurn(content, calls)
    results = pool.call_many(parsed.calls)   # malformed calls come back as errors the model sees

A parser never raises on the model's text: a malformed call becomes a ToolCall with `error` set (bad JSON, no name,
arguments not an object, ...), which the pool answers with that error instead of running anything. Whether the
named tool exists and the arguments fit its schema is checked by the pool, which holds the schemas. New families
register with `@PARSERS.register("name")` (rollout.multi_turn.parser selects one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rltrain.registry import Registry
from rltrain.tools.base import ToolCall


@dataclass
class ParsedTurn:
    content: str                                  # the text outside the tool calls, stripped
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


PARSERS: Registry = Registry("tool-call parser")

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Qwen 2.5 / Qwen 3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn.
    An unclosed last tag (generation stopped mid-call) counts as a call, so the model is told it was malformed."""
    calls = []
    for index, match in enumerate(_HERMES_CALL.finditer(text)):
        body, closed = match.group(1).strip(), match.group(0).endswith("</tool_call>")
        call = _call_from_json(body, f"call_{index}")
        if not closed and call.error is None:
            call.error = "the <tool_call> tag is not closed with </tool_call>"
        calls.append(call)
    content = _HERMES_CALL.sub("", text).strip()
    return ParsedTurn(content, calls)


def _call_from_json(body: str, call_id: str) -> ToolCall:
    """A call from the JSON object {"name": str, "arguments": object | JSON string of an object}."""
    quoted = body if len(body) <= 200 else body[:200] + "..."
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", id=call_id, error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): "
                                              f"{quoted}")
    if not isinstance(data, dict):
        return ToolCall("", id=call_id, error=f"the tool call must be a JSON object with \"name\" and "
                                              f"\"arguments\", got: {quoted}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", id=call_id, error=f"the tool call has no \"name\" string: {quoted}")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON-encoded string, as OpenAI's API does
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, id=call_id, error=f"the \"arguments\" of {name!r} must be a JSON object, got: "
                                                f"{json.dumps(arguments)[:200]}")
    return ToolCall(name, arguments, id=call_id)
