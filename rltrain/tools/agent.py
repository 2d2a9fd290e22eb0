"""A black-box agent as the episode (rollout.multi_turn.agent): a function of the user's, named by file and name as
reward functions and environments are, that talks to the policy through an OpenAI-compatible chat-completions
endpoint the rollout worker serves (rltrain/workers/chat_endpoint.py) and returns the episode's reward.

    def solve(row: dict, base_url: str, **kwargs) -> float | None:
        client = openai.OpenAI(base_url=base_url, api_key="rltrain")   # any key: the URL names the episode
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        ...
        return 1.0   # the episode's reward (extra_info["env_reward"]; reward.name=env returns it), None: none

`row` is the episode's data row {prompt, data_source, ground_truth, extra_info}; `base_url` is the episode's own
endpoint, http://127.0.0.1:<port>/episodes/<key>/v1, valid while the episode runs. A plain function runs in a thread
of its own per episode (it may block: the sync OpenAI client, subprocesses); a coroutine function runs on the
rollout's event loop beside the engine (the AsyncOpenAI client; it must never block). Either is abandoned after
timeout_s seconds, its episode kept as it stands. An agent that raises or times out ends its episode without a
reward and counts in tool/env_errors (the first of a batch is logged with its traceback).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from rltrain.config import ConfigError
from rltrain.plugins import import_plugin_file, public_names

AGENT_KEY = "rollout.multi_turn.agent"


@dataclass
class AgentConfig:
    path: str | None = None      # a Python file holding the agent function; null = no agent
    name: str | None = None      # the function in that file: fn(row, base_url, **kwargs) -> reward | None
    kwargs: dict = field(default_factory=dict)   # its extra keyword arguments
    timeout_s: float = 600.0     # an episode's agent is abandoned after this long (its episode ends as it stands)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def validate(self):
        if self.timeout_s <= 0:
            raise ConfigError(f"{AGENT_KEY}.timeout_s: must be > 0 (got {self.timeout_s!r})")
        if self.enabled:
            try:   # imported once here, so a bad file, name or kwargs fails before any worker starts
                load_agent(self)
            except (OSError, ImportError, ValueError) as err:   # their messages start with the key
                raise ConfigError(str(err)) from None


def load_agent(config: AgentConfig):
    """The agent function `config` names (ValueError / ImportError / FileNotFoundError naming the key)."""
    module = import_plugin_file(config.path, f"{AGENT_KEY}.path", "rltrain_agent")
    fn = getattr(module, config.name or "", None)
    if not inspect.isfunction(fn):
        raise ValueError(f"{AGENT_KEY}.name: {config.name!r} is not a function in {config.path!r}; functions there: "
                         f"{', '.join(public_names(module)) or 'none'}")
    try:
        inspect.signature(fn).bind({}, "http://127.0.0.1/v1", **config.kwargs)
    except TypeError as err:
        raise ValueError(f"{AGENT_KEY}.kwargs: {config.name}{inspect.signature(fn)} cannot be called as "
                         f"{config.name}(row, base_url, **{dict(config.kwargs)}) ({err})") from None
    return fn
