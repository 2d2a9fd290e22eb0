"""Loading tools: the three ways to declare one (decorator, module SCHEMA, class), and errors that name the entry's
key, the file and the name when the file, the function or the schema is wrong."""

import re
import textwrap

import pytest
from omegaconf import OmegaConf

from rltrain.tools import ToolSpec, load_tool, load_tools, validate_schema

KEY = "rollout.multi_turn.tools[0]"
RE_KEY = re.escape(KEY)
PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def _file(tmp_path, body, name="my_tools.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_decorator_module_schema_and_class(tmp_path):
    path = _file(tmp_path, f'''
        from rltrain.tools import tool

        @tool("Search the notes.", {PARAMS!r})
        def search(q):
            return q.upper()

        SCHEMA = [{{"type": "function",
                    "function": {{"name": "echo", "description": "Echo.", "parameters": {PARAMS!r}}}}}]

        def echo(q):
            return q

        class Counter:
            schema = {{"name": "count", "description": "Count letters.", "parameters": {PARAMS!r}}}
            def __init__(self, offset=0):
                self.offset = offset
            def __call__(self, q):
                return len(q) + self.offset
    ''')
    tools = load_tools([ToolSpec(path, "search"), ToolSpec(path, "echo"),
                        ToolSpec(path, "Counter", kwargs={"offset": 1}), ToolSpec(builtin="calculator")])
    assert list(tools) == ["search", "echo", "count", "calculator"]
    assert tools["search"].fn(q="a") == "A" and tools["echo"].schema["parameters"] == PARAMS
    assert tools["count"].fn(q="abc") == 4
    assert tools["calculator"].fn(expression="2+2") == "4"


def test_errors_name_key_file_and_name(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match=rf"{RE_KEY}.path: no such file '.*nope.py'"):
        load_tool(ToolSpec(missing, "f"), KEY)
    broken = _file(tmp_path, "import not_a_module_xyz\n", "broken.py")
    with pytest.raises(ImportError, match=rf"{RE_KEY}.path: '.*broken.py' failed to import: ModuleNotFoundError"):
        load_tool(ToolSpec(broken, "f"), KEY)
    path = _file(tmp_path, '''
        def plain(q):
            return q

        class NoSchema:
            def __call__(self, q):
                return q

        class Fragile:
            schema = {"name": "fragile", "description": "x"}
            def __init__(self):
                raise RuntimeError("needs a server")
            def __call__(self):
                return 1
    ''')
    with pytest.raises(ValueError, match=rf"{RE_KEY}.name: 'fetch' is not a function or class in '.*my_tools.py'; "
                                         "there: Fragile, NoSchema, plain"):
        load_tool(ToolSpec(path, "fetch"), KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}.name: 'plain' in '.*my_tools.py' has no schema"):
        load_tool(ToolSpec(path, "plain"), KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}.name: 'NoSchema' in .* has no schema"):
        load_tool(ToolSpec(path, "NoSchema"), KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}.kwargs: 'Fragile' in .* could not be built.*RuntimeError"):
        load_tool(ToolSpec(path, "Fragile"), KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}.kwargs: only class tools take constructor arguments"):
        load_tool(ToolSpec(path, "plain", kwargs={"x": 1}), KEY)


def test_invalid_schema_and_signature_name_the_tool(tmp_path):
    path = _file(tmp_path, '''
        SCHEMA = {"name": "lookup", "description": "Look up.", "parameters": {"type": "object",
                  "properties": {"key": {"type": "string"}}, "required": ["key", "default"]}}

        def lookup(key, default=None):
            return key

        def narrow(other):
            return other
    ''')
    with pytest.raises(ValueError, match=rf"{RE_KEY}.name: 'lookup' in '.*my_tools.py': .*'parameters.required' "
                                         r"must list names from 'properties' \(key\)"):
        load_tool(ToolSpec(path, "lookup"), KEY)
    bad_signature = _file(tmp_path, '''
        SCHEMA = {"name": "narrow", "description": "x", "parameters": {"type": "object",
                  "properties": {"key": {"type": "string"}}}}

        def narrow(other):
            return other
    ''', "sig.py")
    with pytest.raises(ValueError, match=r"'narrow' in '.*sig.py': tool 'narrow' does not accept its schema's "
                                         r"arguments \(key\)"):
        load_tool(ToolSpec(bad_signature, "narrow"), KEY)


def test_duplicate_names_and_malformed_entries():
    with pytest.raises(ValueError, match=r"tools\[1\]: a second tool named 'calculator'"):
        load_tools([ToolSpec(builtin="calculator"), ToolSpec(builtin="calculator")])
    with pytest.raises(ValueError, match=rf"{RE_KEY}.name: must be a non-empty string"):
        ToolSpec.from_entry({"path": "t.py"}, KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}.url: unknown key; a tool entry has: builtin, kwargs, name, path"):
        ToolSpec.from_entry({"path": "t.py", "name": "f", "url": "x"}, KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}: give either builtin or path \+ name"):
        ToolSpec.from_entry({"builtin": "python", "name": "f"}, KEY)
    with pytest.raises(ValueError, match=rf"{RE_KEY}: must be {{path: file.py, name: fn}}"):
        ToolSpec.from_entry("calculator", KEY)
    node = OmegaConf.create({"builtin": "python", "kwargs": {"wall_s": 2, "extra": [1]}})
    spec = ToolSpec.from_entry(node, KEY)  # a Hydra node becomes plain data, which pickles into the workers
    assert spec == ToolSpec(builtin="python", kwargs={"wall_s": 2, "extra": [1]})
    assert type(spec.kwargs) is dict and type(spec.kwargs["extra"]) is list


@pytest.mark.parametrize("schema, message", [
    ({"name": "has space", "description": "x"}, "'name' must be"),
    ({"name": "t"}, "'description' must be a non-empty string"),
    ({"name": "t", "description": "x", "parameters": {"type": "array"}}, "\"type\": \"object\""),
    ({"name": "t", "description": "x", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}},
     "argument 'a' has type 'int'"),
    ({"name": "t", "description": "x", "parameters": {"type": "object", "properties": {"a": {"default": {1, 2}}}}},
     "not JSON-serializable"),
], ids=["name", "description", "parameters-type", "argument-type", "not-json"])
def test_validate_schema(schema, message):
    with pytest.raises(ValueError, match=message):
        validate_schema(schema)
