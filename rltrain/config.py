"""Typed config slices: each component declares a small dataclass; `from_mapping` builds it from its section of the
Hydra config and rejects unknown keys, wrong types and bad values with a message naming the full key.

    @dataclass
    class RolloutConfig:
        n: int = 8
        def validate(self): require(self.n >= 1, "n", "must be >= 1", self.n)

    rollout = from_mapping(RolloutConfig, cfg.rollout, "rollout")   # ConfigError: "rollout.n: must be >= 1 (got 0)"
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type or a bad value; the message names the key."""


class _FieldError(Exception):
    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")  # the section-relative form, where a config is built by hand
        self.key, self.message = key, message


def require(condition: bool, key: str, message: str, value: Any = dataclasses.MISSING) -> None:
    """Inside a config's validate() (or __post_init__): raise for `key` (relative to the section) unless
    `condition`."""
    if not condition:
        got = "" if value is dataclasses.MISSING else f" (got {value!r})"
        raise _FieldError(key, f"{message}{got}")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_describe(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value, tp, key: str):
    """Return `value` as type `tp` (int -> float widening, tuples -> list) or raise _FieldError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except _FieldError:
                continue
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item_tp,) = typing.get_args(tp)
            return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is Any:
        return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _FieldError(key, f"expected {_describe(tp)}, got {value!r}")


def from_mapping(cls, mapping: Mapping | None, prefix: str):
    """Build dataclass `cls` from `mapping` (a dict or OmegaConf node), validating keys, types and values. Its keys
    are the fields __init__ takes (a field with init=False is not a setting)."""
    mapping = {} if mapping is None else dict(mapping)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix != "config" else unknown[0]
        raise ConfigError(f"{where}: unknown key; {prefix} has: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    values = {}
    try:
        for name, value in mapping.items():
            if dataclasses.is_dataclass(hints[name]):
                values[name] = from_mapping(hints[name], value, name if prefix == "config" else f"{prefix}.{name}")
            else:
                values[name] = _coerce(value, hints[name], name)
        try:
            config = cls(**values)
        except ValueError as err:
            # a slice owned by rltrain_kernels (KernelConfig) validates on construction and names the key itself
            raise ConfigError(str(err)) from None
        if hasattr(config, "validate"):
            config.validate()
    except _FieldError as err:
        where = err.key if prefix == "config" else f"{prefix}.{err.key}"
        raise ConfigError(f"{where}: {err.message}") from None
    return config


def to_dict(config) -> dict:
    return dataclasses.asdict(config)
