"""Loading reward functions: a user's Python file (`reward.path=file.py reward.name=fn`) or a built-in by name.

A reward function has verl's signature, so a verl user's file works unchanged:

    def fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float | dict

A dict return must hold a numeric "score"; its other numeric entries are logged as metrics. A function with a
`sandbox` keyword parameter (the built-in `code` and `default`, or a plug-in's) is given the run's
rltrain.sandbox.Sandbox, built from `reward.sandbox`, to run programs with: `sandbox.run(program, stdin)`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from rltrain.plugins import import_plugin_file, public_names
from rltrain.rewards.builtin import BUILTIN_REWARDS
from rltrain.sandbox import Sandbox, SandboxConfig

RewardFn = Callable[..., "float | dict"]


def takes_sandbox(fn) -> bool:
    try:
        return "sandbox" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def bound_sandbox(fn) -> Sandbox | None:
    """The Sandbox load_reward_fn gave `fn`, or None."""
    return fn.keywords.get("sandbox") if isinstance(fn, functools.partial) else None


def load_reward_fn(path: str | None, name: str, sandbox: SandboxConfig | None = None) -> RewardFn:
    """The function `name` from the file at `path`, or the built-in `name` when `path` is None/empty; one taking a
    `sandbox` keyword with it bound to Sandbox(`sandbox`), which probes its backend at its first run. Errors start
    with the key to fix (`reward.path: ...`, `reward.name: ...`)."""
    fn = _load(path, name)
    return functools.partial(fn, sandbox=Sandbox(sandbox)) if takes_sandbox(fn) else fn


def _load(path: str | None, name: str) -> RewardFn:
    if not path:
        try:
            return BUILTIN_REWARDS.get(name)
        except ValueError as exc:
            raise ValueError(f"reward.name: {exc}") from None
    module = import_plugin_file(path, "reward.path", "rltrain_reward_plugin")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.name: {name!r} is not a function in {path!r}; functions there: "
                         f"{', '.join(public_names(module)) or 'none'}")
    try:
        inspect.signature(fn).bind("source", "solution", "truth", extra_info=None)
    except TypeError as exc:
        raise ValueError(f"reward.name: {name!r} in {path!r} must accept (data_source, solution_str, "
                         f"ground_truth, extra_info=None): {exc}") from None
    return fn
