"""Importing a user's Python file as a plug-in module, shared by reward functions (rltrain/rewards/plugin.py) and
tools (rltrain/tools/loader.py). Errors start with the config key that named the file, so the user knows what to
fix: `reward.path: no such file '/x/y.py'`, `rollout.multi_turn.tools[0].path: '/x/t.py' failed to import: ...`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType


def import_plugin_file(path: str, key: str, namespace: str) -> ModuleType:
    """The module run from the file at `path`, registered in sys.modules under `namespace` + a digest of its resolved
    path (so its pickling and dataclasses find it, and two plug-ins with one file name do not collide). Each call
    runs the file afresh, so an edited file is picked up."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{key}: no such file {str(file)!r}")
    # a digest, not hash(): the name must not depend on PYTHONHASHSEED
    module_name = f"{namespace}_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"{key}: {str(file)!r} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def public_names(module: ModuleType, kind=inspect.isfunction) -> list[str]:
    """The module's public names whose values satisfy `kind` (for 'functions there: ...' hints)."""
    return sorted(n for n, v in vars(module).items() if kind(v) and not n.startswith("_"))
