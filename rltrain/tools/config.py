"""MultiTurnConfig: the `rollout.multi_turn` section (issue 29): whether rollouts are multi-turn episodes with tools,
how long they may run, which tools the model gets and how its tool calls are parsed.

    rollout:
      multi_turn:
        enabled: true
        max_turns: 4                     # assistant turns per episode (the last one gets no tool answers)
        max_tool_response_tokens: 256    # a tool message is cut to this many tokens before it joins the context
        tools: [{builtin: calculator}, {path: my_tools.py, name: search}]
        parser: hermes

Instead of tools, an environment (`env`, rltrain/tools/environment.py) answers the model's turns, or a black-box
agent (`agent`, rltrain/tools/agent.py) is the whole episode, talking to the policy through an OpenAI-compatible
endpoint.

validate() imports every tool (like reward.path), so a bad file, name or schema fails before any worker starts,
with the entry's key: `rollout.multi_turn.tools[1].name: 'search' is not a function or class in 'my_tools.py'`; and
a `python` tool where no sandbox backend works (rltrain/sandbox/) fails there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltrain.config import ConfigError, require
from rltrain.sandbox import SandboxUnavailable
from rltrain.tools.agent import AgentConfig
from rltrain.tools.builtin.python import PythonTool
from rltrain.tools.loader import TOOLS_KEY, ToolSpec, load_tools
from rltrain.tools.parsers import PARSERS
from rltrain.tools.pool import ToolPool
from rltrain.tools.environment import EnvConfig


@dataclass
class MultiTurnConfig:
    enabled: bool = False
    max_turns: int = 4                   # assistant turns per episode
    max_tool_response_tokens: int = 256  # tokens of one tool message kept in the context
    tools: list[Any] = field(default_factory=list)  # {path: file.py, name: fn} | {builtin: calculator | python}
    parser: str = "hermes"               # tool-call format of the chat template's family (rltrain/tools/parsers.py)
    tool_timeout_s: float = 10.0         # per call; past it the worker is killed and the model told so
    num_workers: int = 4                 # tool processes: calls of all episodes in a turn run this many at a time
    max_output_chars: int = 4000         # a tool's answer is cut to this many characters (before tokenizing)
    env: EnvConfig = field(default_factory=EnvConfig)   # an environment answers instead of tools (environment.py)
    agent: AgentConfig = field(default_factory=AgentConfig)   # a black-box agent is the episode (agent.py)

    def validate(self):
        require(self.max_turns >= 1, "max_turns", "must be >= 1", self.max_turns)
        require(self.max_tool_response_tokens >= 1, "max_tool_response_tokens", "must be >= 1",
                self.max_tool_response_tokens)
        require(self.parser in PARSERS, "parser", f"unknown tool-call parser; known: {', '.join(PARSERS.names())}",
                self.parser)
        require(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0", self.tool_timeout_s)
        require(self.num_workers >= 1, "num_workers", "must be >= 1", self.num_workers)
        require(self.max_output_chars >= 1, "max_output_chars", "must be >= 1", self.max_output_chars)
        require(not self.enabled or bool(self.tools) or self.env.enabled or self.agent.enabled, "tools", "must list "
                "at least one tool when enabled, e.g. [{builtin: calculator}] or [{path: my_tools.py, name: fn}] (or "
                "set rollout.multi_turn.env or rollout.multi_turn.agent)", self.tools)
        require(not (self.tools and self.env.enabled), "env", "answers the model's turns instead of tools: set "
                "rollout.multi_turn.tools=[] with it (an environment may call tools itself)", self.env.path)
        require(not self.env.enabled or self.enabled, "env", "needs rollout.multi_turn.enabled=true (its episodes "
                "are multi-turn)", self.env.path)
        require(not (self.agent.enabled and (self.tools or self.env.enabled)), "agent", "is the whole episode "
                "(it runs its own tools and decides what the model reads): set rollout.multi_turn.tools=[] and "
                "rollout.multi_turn.env.path=null with it", self.agent.path)
        require(not self.agent.enabled or self.enabled, "agent", "needs rollout.multi_turn.enabled=true (its "
                "episodes are multi-turn)", self.agent.path)
        try:  # imported once here (the pool imports them again), so a bad file, name or schema fails up front
            loaded = load_tools(self.tool_specs())
        except (OSError, ImportError, ValueError) as err:  # their messages start with the entry's key
            raise ConfigError(str(err)) from None
        for i, tool in enumerate(loaded.values()):
            if isinstance(tool.fn, PythonTool):
                require(tool.fn.wall_s < self.tool_timeout_s, "tool_timeout_s", f"must exceed the python tool's "
                        f"wall-clock limit (tools[{i}].kwargs.wall_s = {tool.fn.wall_s:g}), so a slow program is "
                        "reported as such instead of as a tool timeout", self.tool_timeout_s)
                try:  # the probe (logged): never a python tool without isolation
                    tool.fn.sandbox.backend
                except SandboxUnavailable as exc:
                    raise ConfigError(f"{TOOLS_KEY}[{i}]: the python tool runs the model's programs in a sandbox, "
                                      f"and {exc}") from None

    @property
    def needs_rows(self) -> bool:
        """Whether the rollout needs each prompt's data row (an environment's reset, an agent's call read it)."""
        return self.env.enabled or self.agent.enabled

    def tool_specs(self) -> list[ToolSpec]:
        specs = []
        for i, entry in enumerate(self.tools):
            try:
                specs.append(ToolSpec.from_entry(entry, f"{TOOLS_KEY}[{i}]"))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        return specs

    def tool_names(self) -> list[str]:
        """The tools' names as the model calls them (their schemas'), loaded from tool_specs."""
        return list(load_tools(self.tool_specs()))

    def build_pool(self) -> ToolPool:
        return ToolPool(self.tool_specs(), self.tool_timeout_s, self.num_workers, self.max_output_chars)
