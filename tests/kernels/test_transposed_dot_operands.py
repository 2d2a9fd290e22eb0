"""No Triton kernel of ours feeds a tensor-core dot the transpose of another dot's result.

Triton 3.4–3.7.0 miscompiles that pattern on Hopper (fla #640: the layout conversion of tl.trans(dot result) gave
dk off by 10–15%), and the device's Triton is 3.6, so the kernels build such transposes as dots of their own from
loaded tiles, or through a scratch tile (ops/common/scratch.py). The interpreter computes the pattern correctly,
so only this static check can keep it out between GPU runs: every @triton.jit function under rltrain_kernels/ops
is parsed, values derived from a dot (mm / tl.dot, and anything computed from one) are tracked through
assignments, and a dot whose operand is tl.trans / tl.permute / .T of such a value fails the test.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

OPS = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "rltrain_kernels" / "ops"
DOTS = {"mm", "dot"}            # ops/common/precision.mm and tl.dot
TRANSPOSES = {"trans", "permute"}


def call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return None


def jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


class DotTaint(ast.NodeVisitor):
    """Names holding dot-derived values (to a fixpoint over the body, for loops), then the offending dots."""

    def __init__(self):
        self.tainted: set[str] = set()
        self.findings: list[tuple[int, str]] = []

    def derived(self, node: ast.AST) -> bool:
        return any(call_name(n) in DOTS or (isinstance(n, ast.Name) and n.id in self.tainted)
                   for n in ast.walk(node))

    def transposed_derived(self, operand: ast.AST) -> bool:
        if call_name(operand) in TRANSPOSES:
            return self.derived(operand.args[0])
        if isinstance(operand, ast.Attribute) and operand.attr == "T":
            return self.derived(operand.value)
        return False

    def spread(self, function: ast.FunctionDef) -> None:
        while True:
            before = len(self.tainted)
            for node in ast.walk(function):
                targets, value = [], None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                    targets, value = [node.target], node.value
                if value is not None and self.derived(value):
                    self.tainted |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if len(self.tainted) == before:
                return

    def check(self, function: ast.FunctionDef) -> None:
        self.spread(function)
        for node in ast.walk(function):
            if call_name(node) in DOTS:
                for operand in node.args[:2]:
                    if self.transposed_derived(operand):
                        self.findings.append((node.lineno, ast.unparse(node)))


def scan(source: str) -> list[tuple[int, str]]:
    findings = []
    for function in jit_functions(ast.parse(source)):
        taint = DotTaint()
        taint.check(function)
        findings += [(line, f"{function.name}: {code}") for line, code in taint.findings]
    return findings


def test_no_kernel_transposes_a_dot_result_into_a_dot():
    files = sorted(OPS.rglob("*.py"))
    kernels = sum(len(list(jit_functions(ast.parse(path.read_text())))) for path in files)
    assert kernels >= 30  # the scan sees the kernels (a decorator change would silently empty it)
    findings = [f"{path.relative_to(OPS)}:{line}: {code}" for path in files for line, code in scan(path.read_text())]
    assert not findings, "tl.trans of a dot result fed to a dot (miscompiled on Hopper, fla #640):\n" + \
        "\n".join(findings)


@pytest.mark.parametrize("body,found", [
    ("c = mm(a, b, P)\n    d = mm(tl.trans(c), b, P)", True),                      # direct
    ("c = tl.where(m, -mm(a, b, P), 0.0) * s\n    d = tl.dot(a, tl.trans(c))", True),  # through arithmetic
    ("for i in range(2):\n        d = mm(tl.trans(c), b, P)\n        c += mm(a, b, P)", True),  # loop-carried
    ("c = mm(a, b, P)\n    d = mm(c.T, b, P)", True),
    ("c = tl.load(p)\n    d = mm(tl.trans(c), b, P)", False),                      # a loaded tile
    ("c = mm(a, b, P)\n    d = mm(c, tl.trans(b), P)", False),                     # dot result, not transposed
    ("c = mm(a, b, P)\n    e = tl.trans(c) * 2", False),                           # transposed, not into a dot
])
def test_the_check_finds_the_pattern(body, found):
    source = f"@triton.jit\ndef kernel(a, b, p, m, s, P: tl.constexpr):\n    c = tl.zeros([16, 16])\n    {body}\n"
    assert bool(scan(source)) is found
