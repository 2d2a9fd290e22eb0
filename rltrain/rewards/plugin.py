"""Loading reward functions: a user's Python file (`reward.path=file.py reward.name=fn`) or a built-in by name.

A reward function has verl's signature, so a verl user's file works unchanged:

    def fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float | dict

A dict return must hold a numeric "score"; its other numeric entries are logged as metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from rltrain.plugins import import_plugin_file, public_names
from rltrain.rewards.builtin import BUILTIN_REWARDS

RewardFn = Callable[..., "float | dict"]


def load_reward_fn(path: str | None, name: str) -> RewardFn:
    """The function `name` from the file at `path`, or the built-in `name` when `path` is None/empty. Errors start
    with the key to fix (`reward.path: ...`, `reward.name: ...`)."""
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
