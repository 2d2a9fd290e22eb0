"""What a tool is, and the records a multi-turn rollout exchanges with the tool runtime.

A tool is a Python callable with a JSON schema in the OpenAI function-calling form (the form chat templates take
through `tokenizer.apply_chat_template(messages, tools=...)`):

    @tool(description="Add two integers.",
          parameters={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]})
    def add(a, b):
        return a + b

or a plain function beside a module-level `SCHEMA` (one schema dict, or a list of them matched by "name"), or a
class with a `schema` attribute and `__call__` (instantiated once per worker process). The model calls it with
keyword arguments, checked against the schema before the tool runs (required names present, no unknown names unless
the schema sets "additionalProperties": true, top-level JSON types); a non-string return value is sent back as JSON.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
              "object": (dict,), "null": (type(None),)}


@dataclass
class ToolCall:
    """One call parsed from the model's text. `error` is set when the text held a malformed call (bad JSON, no
    name, ...): the pool does not run it and answers with the error instead, so the model sees what went wrong."""
    name: str
    arguments: dict = field(default_factory=dict)
    id: str = ""
    error: str | None = None


@dataclass
class ToolResult:
    """The answer to one ToolCall. `content` is what the model sees (an error reads "Error: ..."); status is ok |
    error (raised, crashed its worker, or returned something not JSON-serializable) | timeout | invalid (malformed
    call, unknown tool, arguments not matching the schema). worker_died: the error was the tool's worker process
    dying (os._exit, a segfault, the out-of-memory killer)."""
    name: str
    content: str
    status: str = "ok"
    call_id: str = ""
    elapsed_s: float = 0.0
    worker_died: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def tool(description: str, parameters: dict | None = None, name: str | None = None):
    """Decorator: attach an OpenAI-style schema to a function (its name defaults to the function's)."""
    def decorate(fn):
        fn.schema = validate_schema({"name": name or fn.__name__, "description": description,
                                     "parameters": parameters or {"type": "object", "properties": {}}})
        return fn
    return decorate


def validate_schema(schema) -> dict:
    """The schema in its inner form {name, description, parameters} (an outer {"type": "function", "function": ...}
    is unwrapped). Raises ValueError naming the field that is wrong."""
    if isinstance(schema, dict) and schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        schema = schema["function"]
    if not isinstance(schema, dict):
        raise ValueError(f"the schema must be a dict with name, description, parameters, got {type(schema).__name__}")
    name = schema.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"schema 'name' must be an identifier-like string of at most 64 characters, got {name!r}")
    if not isinstance(schema.get("description"), str) or not schema["description"].strip():
        raise ValueError(f"schema of {name!r}: 'description' must be a non-empty string (the model reads it)")
    params = schema.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"schema of {name!r}: 'parameters' must be a JSON schema with \"type\": \"object\", "
                         f"got {params!r}")
    properties = params.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        raise ValueError(f"schema of {name!r}: 'parameters.properties' must map argument names to schemas")
    for arg, prop in properties.items():
        kind = prop.get("type")
        if kind is not None and not all(k in JSON_TYPES for k in ([kind] if isinstance(kind, str) else kind)):
            raise ValueError(f"schema of {name!r}: argument {arg!r} has type {kind!r}; JSON types: "
                             f"{', '.join(JSON_TYPES)}")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in properties for r in required):
        raise ValueError(f"schema of {name!r}: 'parameters.required' must list names from 'properties' "
                         f"({', '.join(properties) or 'none'}), got {required!r}")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"schema of {name!r} is not JSON-serializable: {exc}") from None
    return {"name": name, "description": schema["description"], "parameters": params}


def check_signature(fn, schema: dict) -> None:
    """Raise ValueError unless `fn` accepts every argument of the schema as a keyword."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust the schema
    properties = schema["parameters"].get("properties", {})
    try:
        signature.bind_partial(**dict.fromkeys(properties))
    except TypeError as exc:
        raise ValueError(f"tool {schema['name']!r} does not accept its schema's arguments "
                         f"({', '.join(properties) or 'none'}) as keywords: {exc}") from None
    missing = [p.name for p in signature.parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in schema["parameters"].get("required", [])]
    if missing:
        raise ValueError(f"tool {schema['name']!r} needs argument(s) {', '.join(missing)} that its schema does "
                         f"not list as required")


def check_arguments(schema: dict, arguments) -> str | None:
    """Why `arguments` do not fit the schema (missing/unknown names, top-level JSON types), or None if they do."""
    if not isinstance(arguments, dict):
        return f"the arguments of {schema['name']!r} must be a JSON object, got {type(arguments).__name__}"
    params = schema["parameters"]
    properties = params.get("properties", {})
    missing = [r for r in params.get("required", []) if r not in arguments]
    if missing:
        return f"{schema['name']!r} is missing required argument(s): {', '.join(missing)}"
    if params.get("additionalProperties", False) is False:
        unknown = [a for a in arguments if a not in properties]
        if unknown:
            return (f"{schema['name']!r} got unknown argument(s) {', '.join(map(repr, unknown))}; it takes: "
                    f"{', '.join(properties) or 'none'}")
    for arg, value in arguments.items():
        kind = properties.get(arg, {}).get("type")
        if kind is None:
            continue
        kinds = [kind] if isinstance(kind, str) else kind
        fits = any(isinstance(value, JSON_TYPES[k]) and not (k in ("integer", "number") and isinstance(value, bool))
                   for k in kinds)
        if not fits:
            return f"argument {arg!r} of {schema['name']!r} must be of type {kind}, got {json.dumps(value)[:80]}"
    return None
