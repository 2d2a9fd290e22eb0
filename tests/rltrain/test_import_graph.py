"""rltrain's import graph: no cycles among its modules, and imports inside functions only for optional packages,
each saying so (a comment on its line, or a `try` that turns its ImportError into a message).

The graph is read from the source with `ast` (nothing is imported): an edge A → B for every import of rltrain.B
that runs when A is imported (module level, class bodies and `if` / `try` blocks included; `if TYPE_CHECKING:`
too, so a cycle cannot hide there). `from rltrain.x import y` is an edge to rltrain.x.y when that is a module, else
to rltrain.x; importing a module also runs its packages' __init__ (an edge to each package that does not contain A).
"""

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2] / "rltrain"

# Imports a function may hold: optional packages, each with why (every other import is at the top of its module).
OPTIONAL = {
    "vllm": "rollout.engine=vllm: the vllm extra (pyproject.toml)",
    "matplotlib": "rltrain.plot: the plot extra",
    "wandb": "trainer.logger=wandb: not a dependency",
    "torch.utils.tensorboard": "trainer.logger=tensorboard: needs the tensorboard package, not a dependency",
    "peft": "actor.lora only (rltrain/workers/lora.py): a dependency, but 0.8 s of import in every process else",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def absolute(node: ast.ImportFrom, importer: str) -> str:
    """The module an ImportFrom names, relative imports resolved against `importer`."""
    if not node.level:
        return node.module
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package(importer) else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """Every module the import statement names (for `from x import y`: x.y where that is a module, else x)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = absolute(node, importer)
    return list(dict.fromkeys(f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                              for a in node.names))


def catches_import_error(node: ast.Try) -> bool:
    names = {getattr(h.type, "id", None) for h in node.handlers}
    names |= {getattr(e, "id", None) for h in node.handlers if isinstance(h.type, ast.Tuple) for e in h.type.elts}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def walk_imports(tree: ast.AST):
    """(import node, inside a function, inside a `try` that catches ImportError) for every import in `tree`."""
    def visit(node, in_function, guarded):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function, guarded
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.Lambda)),
                             guarded or isinstance(child, ast.Try) and catches_import_error(child))
    yield from visit(tree, False, False)


class FunctionImport(NamedTuple):
    where: str        # module:line
    target: str       # the module imported
    explained: bool   # a comment on its line, or a `try` around it that catches ImportError

    def optional(self) -> bool:
        return any(self.target == name or self.target.startswith(name + ".") for name in OPTIONAL)


def import_graph() -> tuple[dict[str, set[str]], list[FunctionImport]]:
    """({module: the rltrain modules importing it runs}, every import inside a function)."""
    graph, in_functions = {name: set() for name in MODULES}, []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, in_function, guarded in walk_imports(ast.parse("\n".join(lines), str(path))):
            for target in imported_modules(node, name):
                if in_function:
                    commented = any("#" in line for line in lines[node.lineno - 1:node.end_lineno])
                    in_functions.append(FunctionImport(f"{name}:{node.lineno}", target, guarded or commented))
                    continue
                parts = target.split(".")
                for depth in range(1, len(parts) + 1):  # the packages' __init__ run first
                    prefix = ".".join(parts[:depth])
                    if prefix in MODULES and not (name + ".").startswith(prefix + "."):  # not A's own packages
                        graph[name].add(prefix)
    return graph, in_functions


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_cycle_finder_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve():
    same, parent = ast.parse("from . import sampling\nfrom ..config import require").body
    assert imported_modules(same, "rltrain.workers.rollout") == ["rltrain.workers.sampling"]
    assert absolute(same, "rltrain.workers") == "rltrain.workers"   # in a package's __init__
    assert absolute(parent, "rltrain.workers.rollout") == "rltrain.config"


def test_function_and_guarded_imports_are_told_apart():
    tree = ast.parse("import a\ndef f():\n    import b\n    try:\n        import c\n    except ImportError:\n"
                     "        pass\n")
    assert [(node.names[0].name, in_function, guarded) for node, in_function, guarded in walk_imports(tree)] == \
        [("a", False, False), ("b", True, False), ("c", True, True)]


def test_graph_sees_the_imports():
    graph, _ = import_graph()
    assert "rltrain.config" in graph["rltrain.job"]
    assert "rltrain.tools" in graph["rltrain.workers.agent_loop"]  # the package __init__ runs
    assert "rltrain.tools" not in graph["rltrain.tools.pool"]       # its own package is already running


def test_no_import_cycles():
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_imports_inside_functions_are_optional_packages():
    """A function-level import hides a dependency (and, among rltrain's modules, a cycle): only optional packages
    may wait for the function that needs them (OPTIONAL, each with its reason), and the import says so."""
    _, in_functions = import_graph()
    assert [f"{i.where} imports {i.target}" for i in in_functions if not i.optional()] == []
    assert [f"{i.where} imports {i.target} without a comment" for i in in_functions if not i.explained] == []
