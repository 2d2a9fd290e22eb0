"""Tools for multi-turn rollouts (issue 29): tool definitions and loading, tool-call parsers, the worker pool that
runs calls with timeouts, the built-in calculator and sandboxed python tools, and the chat-template hand-off.
The multi-turn generation loop builds on this API; see rltrain/tools/pool.py for how calls run."""

from rltrain.tools.base import ToolCall, ToolResult, check_arguments, tool, validate_schema
from rltrain.tools.chat import assistant_message, chat_template_tools, tool_message
from rltrain.tools.config import MultiTurnConfig
from rltrain.tools.loader import BUILTIN_TOOLS, LoadedTool, ToolSpec, load_tool, load_tools
from rltrain.tools.parsers import PARSERS, ParsedTurn, parse_hermes
from rltrain.tools.pool import ToolPool

__all__ = ["BUILTIN_TOOLS", "PARSERS", "LoadedTool", "MultiTurnConfig", "ParsedTurn", "ToolCall", "ToolPool",
           "ToolResult", "ToolSpec", "assistant_message", "chat_template_tools", "check_arguments", "load_tool",
           "load_tools", "parse_hermes", "tool", "tool_message", "validate_schema"]
