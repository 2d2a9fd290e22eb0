"""Loading reward functions: a user's Python file (`reward.path=file.py reward.name=fn`) or a built-in by name.

A reward function has verl's signature, so a verl user's file works unchanged:

    def fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float | dict

A dict return must hold a numeric "score"; its other numeric entries are logged as metrics.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

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
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"reward.path: no such file {str(file)!r}")
    module_name = f"rltrain_reward_plugin_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets the plugin's own pickling/dataclasses find it
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"reward.path: {str(file)!r} failed to import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"reward.name: {name!r} is not a function in {str(file)!r}; functions there: "
                         f"{', '.join(available) or 'none'}")
    try:
        inspect.signature(fn).bind("source", "solution", "truth", extra_info=None)
    except TypeError as exc:
        raise ValueError(f"reward.name: {name!r} in {str(file)!r} must accept (data_source, solution_str, "
                         f"ground_truth, extra_info=None): {exc}") from None
    return fn
