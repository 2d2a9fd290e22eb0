"""Every op folder of rltrain_kernels.ops has one shape (fla's `ops/`): `__init__.py` re-exporting the public names,
`function.py` the public entry, `naive.py` the plain-PyTorch reference; and no op imports another op's internals:
what two ops share lives in `ops/common` (an op may import another op's package, i.e. its public names, as the delta
rules import `l2norm`), and `ops/common` imports no op.

Read from the source with `ast`: nothing is imported. Run: `pytest tests/kernels/ops/test_op_folders.py`.
"""

import ast
from pathlib import Path

OPS = Path(__file__).resolve().parents[3] / "kernels" / "rltrain_kernels" / "ops"
PACKAGE = "rltrain_kernels.ops"
SHAPE = ("__init__.py", "function.py", "naive.py")


def op_folders() -> list[Path]:
    return sorted(p for p in OPS.iterdir() if (p / "__init__.py").exists() and p.name != "common")


def imported_modules(path: Path) -> set[str]:
    """Every module under rltrain_kernels.ops that `path` imports (`from x import y`: x.y where that is a module)."""
    folder = path.parent.name
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative to rltrain_kernels.ops.<folder>
                base = [PACKAGE, folder][:3 - node.level] if node.level <= 2 else []
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                parts = candidate.split(".")
                is_module = len(parts) > 3 and (OPS.joinpath(*parts[2:]).with_suffix(".py").exists()
                                                or OPS.joinpath(*parts[2:], "__init__.py").exists())
                modules.add(candidate if is_module else module)
    return {m for m in modules if m.startswith(f"{PACKAGE}.")}


def test_every_op_folder_has_the_same_shape():
    folders = op_folders()
    assert {"gated_delta_rule", "policy_loss", "rmsnorm"} <= {p.name for p in folders}  # the discovery works
    missing = {p.name: [f for f in SHAPE if not (p / f).exists()] for p in folders}
    assert not any(missing.values()), f"op folders without {SHAPE}: { {k: v for k, v in missing.items() if v} }"


def test_op_init_only_reexports():
    """An op's __init__.py holds its docstring, imports from its own modules and __all__: no code of its own."""
    for folder in op_folders():
        tree = ast.parse((folder / "__init__.py").read_text())
        body = tree.body[1:] if ast.get_docstring(tree) else tree.body
        for node in body:
            reexport = isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith(
                f"{PACKAGE}.{folder.name}."))
            names_all = isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]
            assert reexport or names_all, f"{folder.name}/__init__.py line {node.lineno}: only re-exports belong here"
        assert "__all__" in {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets}, folder.name


def test_no_op_imports_another_ops_internals():
    violations = []
    for path in sorted(OPS.rglob("*.py")):
        folder = path.relative_to(OPS).parts[0]
        if folder == "__init__.py":
            continue
        for module in imported_modules(path):
            other = module.split(".")[2]
            if other == folder:
                continue
            if folder == "common" or (other != "common" and module != f"{PACKAGE}.{other}"):
                violations.append(f"{path.relative_to(OPS)} imports {module}")
    assert not violations, "imports across op folders (share through ops/common):\n  " + "\n  ".join(violations)
