"""Loading tools from their config entries: `{path: file.py, name: fn}` (a user's function or class, imported like a
reward plug-in, rltrain/plugins.py) or `{builtin: calculator}` / `{builtin: python, kwargs: {wall_s: 5}}`.

The controller loads every tool once to check it and read its schema (for the chat template); each worker process
of the ToolPool loads them again from the same specs, so nothing but the specs crosses a process boundary. Errors
start with the entry's key: `rollout.multi_turn.tools[1].name: 'fetch' is not a function or class in 't.py'; ...`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rltrain.plugins import import_plugin_file, public_names
from rltrain.tools.base import check_signature, validate_schema

BUILTIN_TOOLS = {"calculator": "rltrain.tools.builtin.calculator:calculator",
                 "python": "rltrain.tools.builtin.python:PythonTool"}
TOOLS_KEY = "rollout.multi_turn.tools"


@dataclass(frozen=True)
class ToolSpec:
    path: str | None = None
    name: str | None = None
    builtin: str | None = None
    kwargs: dict = field(default_factory=dict)   # constructor arguments of a class tool

    @classmethod
    def from_entry(cls, entry, key: str) -> ToolSpec:
        """A spec from one config entry (a dict or OmegaConf node); ValueError naming `key` when it is malformed."""
        if isinstance(entry, ToolSpec):
            return entry
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}: must be {{path: file.py, name: fn}} or {{builtin: "
                             f"{' | '.join(BUILTIN_TOOLS)}}}, got {entry!r}")
        entry = _plain(entry)
        unknown = sorted(set(entry) - {"path", "name", "builtin", "kwargs"})
        if unknown:
            raise ValueError(f"{key}.{unknown[0]}: unknown key; a tool entry has: builtin, kwargs, name, path")
        if not isinstance(entry.get("kwargs", {}), dict):
            raise ValueError(f"{key}.kwargs: must be a mapping of constructor arguments, got {entry['kwargs']!r}")
        if "builtin" in entry:
            if "path" in entry or "name" in entry:
                raise ValueError(f"{key}: give either builtin or path + name, not both")
            if entry["builtin"] not in BUILTIN_TOOLS:
                raise ValueError(f"{key}.builtin: unknown built-in tool {entry['builtin']!r}; known: "
                                 f"{', '.join(BUILTIN_TOOLS)}")
            return cls(builtin=entry["builtin"], kwargs=entry.get("kwargs", {}))
        for part in ("path", "name"):
            if not isinstance(entry.get(part), str) or not entry[part]:
                raise ValueError(f"{key}.{part}: must be a non-empty string (a tool is {{path: file.py, name: fn}} "
                                 f"or {{builtin: {' | '.join(BUILTIN_TOOLS)}}}), got {entry.get(part)!r}")
        return cls(path=entry["path"], name=entry["name"], kwargs=entry.get("kwargs", {}))


@dataclass
class LoadedTool:
    schema: dict      # inner form: {name, description, parameters}
    fn: object        # the callable: a function, or an instance of a class tool


def load_tool(spec: ToolSpec, key: str) -> LoadedTool:
    """Import and check one tool. Errors name `key` (+ .path / .name / .kwargs) and the file."""
    if spec.builtin:
        module_name, attr = BUILTIN_TOOLS[spec.builtin].split(":")
        obj, where, module = getattr(importlib.import_module(module_name), attr), f"built-in {spec.builtin!r}", None
    else:
        module = import_plugin_file(spec.path, f"{key}.path", "rltrain_tool_plugin")
        obj, where = getattr(module, spec.name, None), f"{spec.name!r} in {spec.path!r}"
        if not callable(obj):
            there = public_names(module, lambda v: inspect.isfunction(v) or inspect.isclass(v))
            raise ValueError(f"{key}.name: {spec.name!r} is not a function or class in {spec.path!r}; there: "
                             f"{', '.join(there) or 'none'}")
    if inspect.isclass(obj):
        schema = getattr(obj, "schema", None)
        try:
            fn = obj(**spec.kwargs)
        except Exception as exc:
            raise ValueError(f"{key}.kwargs: {where} could not be built with {spec.kwargs!r}: "
                             f"{type(exc).__name__}: {exc}") from None
        schema = getattr(fn, "schema", schema)
    else:
        if spec.kwargs:
            raise ValueError(f"{key}.kwargs: only class tools take constructor arguments; {where} is a function")
        fn, schema = obj, getattr(obj, "schema", None) or _module_schema(module, spec.name)
    if schema is None:
        raise ValueError(f"{key}.name: {where} has no schema: decorate it with @rltrain.tools.tool(...), give the "
                         f"file a module-level SCHEMA, or give the class a `schema` attribute")
    try:
        schema = validate_schema(schema)
        check_signature(fn, schema)
    except ValueError as exc:
        raise ValueError(f"{key}.name: {where}: {exc}") from None
    return LoadedTool(schema, fn)


def load_tools(specs: Sequence[ToolSpec], key: str = TOOLS_KEY) -> dict[str, LoadedTool]:
    """Tools by their schema names, in config order; two tools with one name are an error."""
    tools: dict[str, LoadedTool] = {}
    for i, spec in enumerate(specs):
        loaded = load_tool(spec, f"{key}[{i}]")
        name = loaded.schema["name"]
        if name in tools:
            raise ValueError(f"{key}[{i}]: a second tool named {name!r} (names must be unique: the model calls "
                             f"tools by name)")
        tools[name] = loaded
    return tools


def _module_schema(module, name: str | None):
    """The module-level SCHEMA for function `name`: a schema dict, or the entry of a list whose name matches."""
    schema = getattr(module, "SCHEMA", None) if module is not None else None
    if isinstance(schema, (list, tuple)):
        matches = [s for s in schema if isinstance(s, dict) and (s.get("function", s)).get("name") == name]
        return matches[0] if matches else None
    return schema


def _plain(value):
    """OmegaConf nodes (Mappings / Sequences) as plain dicts and lists, so a spec pickles into a worker."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value
