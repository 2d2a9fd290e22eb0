"""What answers the model between the turns of a multi-turn episode (rltrain/workers/agent_loop.py): the tools
(rollout.multi_turn.tools, `ToolObservations`) or an environment of the user's (rollout.multi_turn.env,
`EnvObservations`). Both take every open episode's finished turn at once and append what answers it (`respond`), or
one episode's turn as it finishes (`respond_one`, a coroutine: rollout.mode=async).

An environment is a class named by file and name, as reward functions are, built once per episode with
rollout.multi_turn.env.kwargs:

    class GuessNumber:
        def __init__(self, low=1, high=100): ...
        def reset(self, row: dict) -> list[dict] | None:
            # row: the episode's data row {prompt, data_source, ground_truth, extra_info}; returns the messages that
            # open the episode after the row's prompt (None: the prompt alone)
        def step(self, action: str) -> tuple[list[dict] | None, float | None, bool]:
            # action: the model's turn as text; returns (the messages that answer it, e.g. [{"role": "user",
            # "content": "higher"}], or None; a reward for this step, or None; whether the episode is over)

The episode's env_reward is the sum of its steps' rewards; the reward function receives it as
extra_info["env_reward"] (the built-in `reward.name=env` returns it). An episode ends when the environment says done,
at rollout.multi_turn.max_turns, or at the token budget; an environment that raises ends its episode and counts in
tool/env_errors (the first error of a batch is logged with its traceback). Environments run in the rollout process.
examples/envs/guess_number.py is one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from dataclasses import dataclass, field

from rltrain.config import ConfigError
from rltrain.plugins import import_plugin_file, public_names
from rltrain.tools.chat import assistant_message, tool_message
from rltrain.tools.stream import ToolStream

logger = logging.getLogger(__name__)
ENV_KEY = "rollout.multi_turn.env"


@dataclass
class EnvConfig:
    path: str | None = None      # a Python file holding the environment class; null = none (tools answer)
    name: str | None = None      # the class in that file
    kwargs: dict = field(default_factory=dict)   # its constructor's keyword arguments

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def validate(self):
        if self.enabled:
            try:   # imported once here, so a bad file, name or kwargs fails before any worker starts
                load_environment(self)
            except (OSError, ImportError, ValueError) as err:   # their messages start with the key
                raise ConfigError(str(err)) from None


def load_environment(config: EnvConfig) -> type:
    """The environment class `config` names (ValueError / ImportError / FileNotFoundError naming the key)."""
    module = import_plugin_file(config.path, f"{ENV_KEY}.path", "rltrain_env")
    cls = getattr(module, config.name or "", None)
    if not inspect.isclass(cls):
        raise ValueError(f"{ENV_KEY}.name: {config.name!r} is not a class in {config.path!r}; classes there: "
                         f"{', '.join(public_names(module, inspect.isclass)) or 'none'}")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise ValueError(f"{ENV_KEY}.name: {config.name} has no {' or '.join(missing)} method (an environment has "
                         "reset(row) -> messages | None and step(action) -> (messages | None, reward | None, done))")
    try:
        inspect.signature(cls).bind(**config.kwargs)
    except TypeError as err:
        raise ValueError(f"{ENV_KEY}.kwargs: {config.name}{inspect.signature(cls)} does not take "
                         f"{dict(config.kwargs)} ({err})") from None
    return cls


class ToolObservations:
    """The tool loop: each turn is parsed for calls (rollout.multi_turn.parser). Turn-synchronous (`respond`): every
    episode's calls of the turn go to one ToolPool.call_many. Per episode (`respond_one`, rollout.mode=async): its
    calls go to the pool through a ToolStream as they come. Either way their results answer as tool messages."""

    def __init__(self, parse, pool):
        self.parse, self.pool, self.stream = parse, pool, None

    def reset(self, episodes, rows, observe) -> None:
        pass

    def respond(self, replies, last: bool, observe) -> None:
        """replies: (episode, text, finished) of the turn just generated; observe(episode, messages) appends an
        answer (or ends the episode at its budget)."""
        calling = [(episode, calls) for episode, text, finished in replies
                   if (calls := self._calls(episode, text, finished, last))]
        if not calling:
            return
        results = iter(self.pool.call_many([call for _, calls in calling for call in calls]))
        for episode, calls in calling:   # they waited for their tools together
            self._answer(episode, [next(results) for _ in calls], observe)

    async def respond_one(self, episode, text: str, finished: bool, last: bool, observe) -> None:
        """One episode's turn, its calls run as they come (other episodes' calls run beside them)."""
        calls = self._calls(episode, text, finished, last)
        if calls:
            if self.stream is None:
                self.stream = ToolStream(self.pool)
            results = await asyncio.gather(*(asyncio.wrap_future(self.stream.submit(call)) for call in calls))
            self._answer(episode, results, observe)

    def _calls(self, episode, text: str, finished: bool, last: bool) -> list:
        """The turn's tool calls to answer (none: the episode ends here)."""
        parsed = self.parse(text)
        episode.messages.append(assistant_message(parsed))
        if not finished:  # the turn used up the episode's budget
            episode.done = episode.truncated = True
        elif not parsed.calls or last:
            episode.done = True
        else:
            return parsed.calls
        return []

    def _answer(self, episode, results, observe) -> None:
        messages = []
        for result in results:
            episode.counts["tool_calls"] += 1
            key = {"error": "tool_errors", "timeout": "tool_timeouts", "invalid": "tool_invalid_calls"}.get(
                result.status)
            if key:
                episode.counts[key] += 1
            episode.counts["tool_worker_deaths"] += result.worker_died
            messages.append(tool_message(result))
        observe(episode, messages)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.pool.close()


def checked_step(answer) -> tuple[list | None, float, bool]:
    """An environment's step result as (messages or None, reward, done); TypeError for any other shape."""
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3):
        raise TypeError(f"step must return (messages | None, reward | None, done); got {answer!r}")
    messages, reward, done = answer
    if messages is not None and not isinstance(messages, (list, tuple)):
        raise TypeError(f"step's messages must be a list of chat messages or None; got {messages!r}")
    return messages, float(reward or 0.0), bool(done)


class EnvObservations:
    """An environment of the user's per episode (module docstring): it opens the episode and answers each turn."""

    def __init__(self, cls: type, kwargs: dict):
        self.cls, self.kwargs, self.envs, self.logged = cls, dict(kwargs), {}, False

    def reset(self, episodes, rows, observe) -> None:
        if rows is None or len(rows) != len(episodes):
            raise ValueError(f"{ENV_KEY}: environment episodes need their data rows (got "
                             f"{'none' if rows is None else len(rows)} for {len(episodes)} episodes)")
        self.envs, self.logged = {}, False
        for episode, row in zip(episodes, rows):
            opening = self._call(episode, lambda env: env.reset(row), create=True)
            if opening:
                observe(episode, list(opening))

    def respond(self, replies, last: bool, observe) -> None:
        for episode, text, finished in replies:
            episode.messages.append({"role": "assistant", "content": text})
            if not finished:
                episode.done = episode.truncated = True
                continue
            answer = self._call(episode, lambda env: checked_step(env.step(text)))
            if answer is None:   # the environment raised: the episode ends there
                continue
            messages, reward, done = answer
            episode.env_reward += reward
            if done or last:
                episode.done = True
            elif messages:
                observe(episode, list(messages))

    async def respond_one(self, episode, text: str, finished: bool, last: bool, observe) -> None:
        """One episode's turn (rollout.mode=async): its environment steps in a thread, so a slow step holds up its
        own episode only."""
        await asyncio.to_thread(self.respond, [(episode, text, finished)], last, observe)

    def _call(self, episode, method, create: bool = False):
        """method(the episode's environment); None (the episode over, counted in env_errors) where it raises."""
        try:
            if create:
                self.envs[id(episode)] = self.cls(**self.kwargs)
            return method(self.envs[id(episode)])
        except Exception:
            if not self.logged:   # the batch's first error, with its traceback
                self.logged = True
                logger.warning("%s: %s raised; its episode ends (tool/env_errors counts them):\n%s", ENV_KEY,
                               self.cls.__name__, traceback.format_exc())
            episode.counts["env_errors"] += 1
            episode.done = True
            return None

    def close(self) -> None:
        self.envs = {}
