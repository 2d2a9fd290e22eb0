"""What the delta-rule benchmarks share: the error measure, outputs and gradients of an op for a check, and the
launch settings (ops/common/launch.py's LAUNCH table) from the command line: `--launch NAME=WARPS,STAGES` overrides,
`--set MODULE.NAME=VALUE` (a kernel module's switch), the `--sweep-launch` loop (every warps × stages of the named
entries, each checked against a reference before it is timed; `--isolate` runs each setting in its own process),
`--dot-per-kernel KERNEL=PREC` (one kernel's dot precision, to find which kernel a precision breaks) and
`--value-block` (the state passes' value columns per program, whatever the batch).
Imported by the bench scripts and compile_report.py beside it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(fn, inputs, do) -> list:
    """[o, final state, then the gradient of every input] of fn on fresh leaf copies of `inputs` (the op's five
    tensors, then the initial state; None for an absent one, whose gradient is then None), for the loss ⟨o, do⟩ +
    Σ final state."""
    inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    o, ht = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    (o.float() * do.float()).sum().add(ht.sum()).backward()
    return [o, ht] + [None if t is None else t.grad for t in inputs]


def check_against_reference(label: str, names: list[str], ours: list, reference: list) -> None:
    """Print each relative error of `ours` (outputs_and_grads: the two outputs, then the gradients named in `names`
    after them) against `reference`, and SystemExit when the outputs pass 5e-3 or a gradient 1e-2 (the issues' bf16
    bars). An absent input's None gradient is skipped."""
    errs = {n: rel(a, b) for n, a, b in zip(names, ours, reference) if a is not None}
    print(f"{label}:", ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    worst_out = max(errs[n] for n in names[:2])
    worst_grad = max(e for n, e in errs.items() if n not in names[:2])
    if worst_out > 5e-3 or worst_grad > 1e-2:
        raise SystemExit(f"correctness check failed (outputs {worst_out:.1e}, gradients {worst_grad:.1e})")


@contextlib.contextmanager
def switched(assignments: list[tuple]):
    """Set each (module, attribute, value) for the block, then put every old value back (the precision and structural
    switches of ops/common are module globals)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in assignments]
    for module, name, value in assignments:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def worst_errors(fn, checks: list, references: list) -> tuple[float, float]:
    """(worst output error, worst gradient error) of fn over `checks` [(inputs, do)] against `references`
    (outputs_and_grads of the reference op on the same checks)."""
    errs = [[rel(a, b) for a, b in zip(outputs_and_grads(fn, inputs, do), ref)]
            for (inputs, do), ref in zip(checks, references)]
    return max(max(e[:2]) for e in errs), max(max(e[2:]) for e in errs)


def apply_launch_overrides(overrides: list[str]) -> None:
    """Set LAUNCH entries from "NAME=WARPS,STAGES" strings; SystemExit naming the bad one otherwise."""
    from rltrain_kernels.ops.common.launch import LAUNCH

    for override in overrides:
        name, _, setting = override.partition("=")
        parts = setting.split(",")
        if name not in LAUNCH or len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--launch {override!r}: expected NAME=WARPS,STAGES with NAME one of {sorted(LAUNCH)}")
        LAUNCH[name] = dict(num_warps=int(parts[0]), num_stages=int(parts[1]))


def apply_switches(assignments: list[str]) -> None:
    """Set module globals of the kernels (the tuning settings) from "MODULE.NAME=VALUE" strings,
    MODULE under rltrain_kernels.ops.common (state_pass) or rltrain_kernels.ops (gated_delta_rule.chunk_fwd), VALUE a
    Python literal; SystemExit naming a bad one (no such module or global, or a value of another type)."""
    import ast
    import importlib

    for assignment in assignments:
        target, _, literal = assignment.partition("=")
        module_name, _, name = target.rpartition(".")
        module = None
        for prefix in ("rltrain_kernels.ops.common.", "rltrain_kernels.ops."):
            try:
                module = importlib.import_module(prefix + module_name)
                break
            except ImportError:
                continue
        if not module_name or module is None or not hasattr(module, name) or name.startswith("_"):
            raise SystemExit(f"--set {assignment!r}: no switch {target!r} (expected MODULE.NAME=VALUE, e.g. "
                             "state_pass.NARROW_BV={})")
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--set {assignment!r}: {literal!r} is not a Python literal") from None
        old = getattr(module, name)
        if old is not None and type(value) is not type(old):
            raise SystemExit(f"--set {assignment!r}: {target} is a {type(old).__name__}, got {type(value).__name__}")
        setattr(module, name, value)


VALUE_BLOCKS = ("auto", "wide", "narrow")


def add_launch_arguments(parser, launch_example: str, sweep_help: str, value_block_help: str) -> None:
    """The launch options both delta-rule benches take: --launch, --set, --sweep-launch, --sweep-warps, --isolate and
    --value-block (the help texts that differ per bench given)."""
    parser.add_argument("--launch", nargs="*", default=[], metavar="NAME=WARPS,STAGES",
                        help=f"override ops/common/launch.py entries for this run, e.g. {launch_example}")
    parser.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a kernel module's tuning setting for this run, e.g. state_pass.NARROW_BV={} or "
                             "gated_delta_rule.chunk_fwd.OUTPUT_BLOCKS='(64, 64)'")
    parser.add_argument("--sweep-launch", nargs="*", metavar="KERNEL", help=sweep_help)
    parser.add_argument("--sweep-warps", nargs="+", type=int, default=[2, 4, 8], metavar="WARPS",
                        help="the warp counts --sweep-launch tries (default 2 4 8)")
    parser.add_argument("--isolate", action="store_true",
                        help="--sweep-launch runs each setting in its own process: an illegal memory access (Triton "
                             "3.6 faults at some settings) costs only its row")
    parser.add_argument("--value-block", default="auto", choices=VALUE_BLOCKS, help=value_block_help)


def force_value_block(mode: str) -> None:
    """--value-block: ops/common/state_pass.py's VALUE_BLOCK, the state passes launched with 64 value columns per
    program ("wide", the *_wide LAUNCH entries) or 32 ("narrow") whatever the batch, or by its occupancy rule."""
    if mode not in VALUE_BLOCKS:
        raise SystemExit(f"--value-block {mode!r}: expected one of {VALUE_BLOCKS}")
    from rltrain_kernels.ops.common import state_pass

    state_pass.VALUE_BLOCK = mode


# Set in the child processes of an isolated sweep: the one "NAME=WARPS,STAGES" setting that child runs.
SWEEP_ONE_ENV = "RLTRAIN_SWEEP_ONE"
ISOLATED_TIMEOUT_S = 600  # one setting's compile, check and timing; a hung kernel costs its row, not the sweep


def sweep_launch(names: list[str], grads: Callable[[], list], reference: list,
                 timings: Callable[[], tuple[float, float]], label: str, warps_options=(2, 4, 8),
                 isolate: bool = False) -> None:
    """For each LAUNCH entry in `names`, every (warps, stages) in `warps_options` × {1, 2, 3}: the worst relative
    error of grads() (outputs first two, then gradients) against `reference`, then timings() → (forward ms,
    forward+backward ms), one table row each.
    A setting that raises (out of shared memory, say) gets its exception's name and the sweep goes on. An illegal
    memory access ends the process's CUDA context, and Triton 3.6 on Hopper faults at some settings of these kernels
    (ops/common/launch.py): with `isolate` each setting runs in a child process (this script again, with the same
    arguments and SWEEP_ONE_ENV naming the setting), so a fault costs only its own row."""
    from rltrain_kernels.ops.common.launch import LAUNCH

    for name in names:
        if name not in LAUNCH:
            raise SystemExit(f"--sweep-launch {name!r}: not an entry of ops/common/launch.py ({sorted(LAUNCH)})")
    one = os.environ.get(SWEEP_ONE_ENV)
    if one:  # a child of an isolated sweep: its one row
        name, _, setting = one.partition("=")
        warps, stages = (int(x) for x in setting.split(","))
        print(_sweep_row(name, warps, stages, "", grads, reference, timings), flush=True)
        return
    print(f"| kernel | warps | stages | worst output err | worst grad err | fwd ms ({label}) | fwd+bwd ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for name in names:
        default = dict(LAUNCH[name])
        for warps in warps_options:
            for stages in (1, 2, 3):
                mark = " (default)" if dict(num_warps=warps, num_stages=stages) == default else ""
                if isolate:
                    print(_isolated_row(name, warps, stages, mark), flush=True)
                else:
                    print(_sweep_row(name, warps, stages, mark, grads, reference, timings), flush=True)
        LAUNCH[name] = default


def _sweep_row(name: str, warps: int, stages: int, mark: str, grads, reference, timings) -> str:
    """One sweep row: LAUNCH[name] set to (warps, stages), the worst errors of grads() and the timings; an exception
    gives its name instead."""
    from rltrain_kernels.ops.common.launch import LAUNCH

    LAUNCH[name] = dict(num_warps=warps, num_stages=stages)
    head = f"| {name} | {warps} | {stages}{mark} |"
    try:
        errs = [rel(a, b) for a, b in zip(grads(), reference)]
        t = timings()
    except Exception as exc:  # noqa: BLE001 - reported in the table, the sweep goes on
        return f"{head} {type(exc).__name__} | | | |"
    return f"{head} {max(errs[:2]):.1e} | {max(errs[2:]):.1e} | {t[0]:.3f} | {t[1]:.3f} |"


def _isolated_row(name: str, warps: int, stages: int, mark: str) -> str:
    """Run this script again with the same arguments for one setting (SWEEP_ONE_ENV) and return its row, or one
    saying how the child died (its last error line)."""
    env = {**os.environ, SWEEP_ONE_ENV: f"{name}={warps},{stages}"}
    head = f"| {name} | {warps} | {stages}"
    try:
        proc = subprocess.run([sys.executable, *sys.argv], env=env, capture_output=True, text=True,
                              timeout=ISOLATED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{head}{mark} | child process hung: killed after {ISOLATED_TIMEOUT_S} s | | | |"
    for line in proc.stdout.splitlines():
        if line.startswith(head + " |"):
            return line.replace(head + " |", f"{head}{mark} |", 1)
    errors = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if "Error" in line]
    why = errors[-1] if errors else f"exit status {proc.returncode}, no row"
    return f"{head}{mark} | child process failed: {why[:160]} | | | |"


DOT_PRECISIONS = ("ieee", "tf32", "bf16")
_UNPATCHED_RUN: dict = {}  # launcher class -> its run before override_dot_precision patched it


def override_dot_precision(overrides: list[str]) -> set[str]:
    """From "KERNEL=PREC" strings (KERNEL a Triton kernel's function name such as iplr_bwd_key_kernel, PREC one of
    DOT_PRECISIONS): every later launch of KERNEL gets DOT_PREC=PREC whatever its host code chose, the other kernels
    keep theirs. Only DOT_PREC changes: the intermediates keep the dtype the host allocated (kernels load them into
    fp32 and store through cast_for_store, so any mix computes). Returns the set, growing as launches happen, of the
    kernels overridden so far; compare it with the requested names after a run to catch a misspelt one."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from rltrain_kernels.ops.common.precision import _interpreted

    wanted = {}
    for override in overrides:
        name, _, prec = override.partition("=")
        if not name or prec not in DOT_PRECISIONS:
            raise SystemExit(f"--dot-per-kernel {override!r}: expected KERNEL=PREC with PREC one of {DOT_PRECISIONS}")
        wanted[name] = prec + ("_interpreted" if _interpreted() and prec != "ieee" else "")
    applied: set[str] = set()
    if not wanted:
        return applied
    for cls in (JITFunction, InterpretedFunction):
        _UNPATCHED_RUN.setdefault(cls, cls.run)
        cls.run = _with_dot_override(cls.run, wanted, applied)
    return applied


def restore_dot_precision() -> None:
    """Undo every override_dot_precision so far: each kernel takes its host code's DOT_PREC again."""
    for cls, run in _UNPATCHED_RUN.items():
        cls.run = run
    _UNPATCHED_RUN.clear()


def _with_dot_override(run, wanted: dict[str, str], applied: set[str]):
    def patched(self, *args, **kwargs):
        name = self.fn.__name__
        if name in wanted and "DOT_PREC" in kwargs:
            kwargs["DOT_PREC"] = wanted[name]
            applied.add(name)
        return run(self, *args, **kwargs)

    return patched


def check_overrides_applied(requested: list[str], applied: set[str]) -> None:
    """SystemExit naming the --dot-per-kernel kernels that never launched with a DOT_PREC argument."""
    missing = sorted({o.partition("=")[0] for o in requested} - applied)
    if missing:
        raise SystemExit(f"--dot-per-kernel: no launch of {missing} took a DOT_PREC argument (misspelt kernel name?)")
