"""What the delta-rule benchmarks share: the error measure, outputs and gradients of an op for a check, and the
kernels' launch choices from the command line as one `Tuning` (ops/common/tuning.py) that the benches pass to the
ops: `--launch NAME=WARPS,STAGES` (ops/common/launch.py entries), `--value-block` (the state passes' value columns per
program, whatever the batch), `--output-blocks BK,BV` and `--dot-per-kernel KERNEL=PREC` (one kernel's dot
precision, to find which kernel a precision breaks); and the `--sweep-launch` loop (every warps × stages of the named
entries, each checked against a reference before it is timed; `--isolate` runs each setting in its own process).
Imported by the bench scripts and compile_report.py beside it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from collections.abc import Callable

from rltrain_kernels.ops.common.launch import LAUNCH
from rltrain_kernels.ops.common.tuning import DEFAULT_TUNING, DOT_OVERRIDES, VALUE_BLOCKS, Tuning


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


def worst_errors(fn, checks: list, references: list) -> tuple[float, float]:
    """(worst output error, worst gradient error) of fn over `checks` [(inputs, do)] against `references`
    (outputs_and_grads of the reference op on the same checks)."""
    errs = [[rel(a, b) for a, b in zip(outputs_and_grads(fn, inputs, do), ref)]
            for (inputs, do), ref in zip(checks, references)]
    return max(max(e[:2]) for e in errs), max(max(e[2:]) for e in errs)


def add_tuning_arguments(parser, launch_example: str, sweep_help: str, value_block_help: str) -> None:
    """The launch options both delta-rule benches take: --launch, --value-block, --sweep-launch, --sweep-warps and
    --isolate (the help texts that differ per bench given)."""
    parser.add_argument("--launch", nargs="*", default=[], metavar="NAME=WARPS,STAGES",
                        help=f"another setting of ops/common/launch.py entries for this run, e.g. {launch_example}")
    parser.add_argument("--value-block", default="auto", choices=VALUE_BLOCKS, help=value_block_help)
    parser.add_argument("--sweep-launch", nargs="*", metavar="KERNEL", help=sweep_help)
    parser.add_argument("--sweep-warps", nargs="+", type=int, default=[2, 4, 8], metavar="WARPS",
                        help="the warp counts --sweep-launch tries (default 2 4 8)")
    parser.add_argument("--isolate", action="store_true",
                        help="--sweep-launch runs each setting in its own process: an illegal memory access (Triton "
                             "3.6 faults at some settings) costs only its row")


def tuning_from_args(args) -> Tuning:
    """The Tuning a bench's arguments ask for: --launch, --value-block and, where the bench has them,
    --output-blocks and --dot-per-kernel; SystemExit naming a bad value."""
    output_blocks = getattr(args, "output_blocks", None)
    try:
        return Tuning(launches=parse_launch(args.launch), value_block=args.value_block,
                      output_blocks=None if output_blocks is None else parse_blocks(output_blocks, "--output-blocks"),
                      dots=parse_dot_per_kernel(getattr(args, "dot_per_kernel", None) or []))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def parse_launch(overrides: list[str]) -> dict[str, tuple[int, int]]:
    """{name: (warps, stages)} from "NAME=WARPS,STAGES" strings; SystemExit naming the bad one otherwise."""
    launches = {}
    for override in overrides:
        name, _, setting = override.partition("=")
        parts = setting.split(",")
        if name not in LAUNCH or len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--launch {override!r}: expected NAME=WARPS,STAGES with NAME one of {sorted(LAUNCH)}")
        launches[name] = (int(parts[0]), int(parts[1]))
    return launches


def parse_blocks(spec: str, flag: str) -> tuple[int, int]:
    """(BK, BV) from "BK,BV", each a power of two from 16 to 256; SystemExit naming `flag` otherwise."""
    parts = spec.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) in (16, 32, 64, 128, 256) for p in parts):
        raise SystemExit(f"{flag} {spec!r}: expected BK,BV, each a power of two from 16 to 256")
    return int(parts[0]), int(parts[1])


# The modules whose Triton kernels take a DOT_PREC that Tuning.dots can replace, under rltrain_kernels.ops.
DOT_KERNEL_MODULES = ("common.wy", "common.wy_bwd", "common.state_pass", "common.chunk_bwd",
                      "gated_delta_rule.chunk_fwd", "gated_delta_product.chunk_fwd", "iplr_delta_rule.chunk_fwd",
                      "iplr_delta_rule.chunk_bwd", "kda.intra", "kda.chunk_fwd", "kda.chunk_bwd")


def dot_kernels() -> set[str]:
    """Names of the delta-rule Triton kernels launched with a DOT_PREC: what --dot-per-kernel may name."""
    names = set()
    for path in DOT_KERNEL_MODULES:
        for name, obj in vars(importlib.import_module(f"rltrain_kernels.ops.{path}")).items():
            if name.endswith("_kernel") and "DOT_PREC" in getattr(obj, "arg_names", ()):
                names.add(name)
    return names


def parse_dot_per_kernel(overrides: list[str]) -> dict[str, str]:
    """{kernel: precision} from "KERNEL=PREC" strings (KERNEL a Triton kernel's function name such as
    iplr_bwd_key_kernel, PREC one of DOT_OVERRIDES); SystemExit naming a bad one or a kernel that takes no DOT_PREC."""
    dots = {}
    for override in overrides:
        name, _, prec = override.partition("=")
        if prec not in DOT_OVERRIDES:
            raise SystemExit(f"--dot-per-kernel {override!r}: expected KERNEL=PREC with PREC one of {DOT_OVERRIDES}")
        dots[name] = prec
    unknown = sorted(set(dots) - dot_kernels()) if dots else []
    if unknown:
        raise SystemExit(f"--dot-per-kernel: {unknown} take no DOT_PREC (the kernels that do: {sorted(dot_kernels())})")
    return dots


def with_launch(tuning: Tuning, name: str, warps: int, stages: int) -> Tuning:
    """`tuning` with LAUNCH entry `name` at (warps, stages)."""
    return dataclasses.replace(tuning, launches={**tuning.launches, name: (warps, stages)})


# Set in the child processes of an isolated sweep: the one "NAME=WARPS,STAGES" setting that child runs.
SWEEP_ONE_ENV = "RLTRAIN_SWEEP_ONE"
ISOLATED_TIMEOUT_S = 600  # one setting's compile, check and timing; a hung kernel costs its row, not the sweep


def sweep_launch(names: list[str], grads: Callable[[Tuning], list], reference: list,
                 timings: Callable[[Tuning], tuple[float, float]], label: str, warps_options=(2, 4, 8),
                 isolate: bool = False, base: Tuning = DEFAULT_TUNING) -> None:
    """For each LAUNCH entry in `names`, every (warps, stages) in `warps_options` × {1, 2, 3} set on `base`: the
    worst relative error of grads(tuning) (outputs first two, then gradients) against `reference`, then
    timings(tuning) → (forward ms, forward+backward ms), one table row each.
    A setting that raises (out of shared memory, say) gets its exception's name and the sweep goes on. An illegal
    memory access ends the process's CUDA context, and Triton 3.6 on Hopper faults at some settings of these kernels
    (ops/common/launch.py): with `isolate` each setting runs in a child process (this script again, with the same
    arguments and SWEEP_ONE_ENV naming the setting), so a fault costs only its own row."""
    for name in names:
        if name not in LAUNCH:
            raise SystemExit(f"--sweep-launch {name!r}: not an entry of ops/common/launch.py ({sorted(LAUNCH)})")
    one = os.environ.get(SWEEP_ONE_ENV)
    if one:  # a child of an isolated sweep: its one row
        name, _, setting = one.partition("=")
        warps, stages = (int(x) for x in setting.split(","))
        print(_sweep_row(with_launch(base, name, warps, stages), name, "", grads, reference, timings), flush=True)
        return
    print(f"| kernel | warps | stages | worst output err | worst grad err | fwd ms ({label}) | fwd+bwd ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for name in names:
        default = base.launch(name)
        for warps in warps_options:
            for stages in (1, 2, 3):
                mark = " (default)" if dict(num_warps=warps, num_stages=stages) == default else ""
                if isolate:
                    print(_isolated_row(name, warps, stages, mark), flush=True)
                else:
                    print(_sweep_row(with_launch(base, name, warps, stages), name, mark, grads, reference, timings),
                          flush=True)


def _sweep_row(tuning: Tuning, name: str, mark: str, grads, reference, timings) -> str:
    """One sweep row: the worst errors of grads(tuning) and timings(tuning) at `tuning`'s setting of LAUNCH entry
    `name`; an exception gives its name instead."""
    setting = tuning.launch(name)
    head = f"| {name} | {setting['num_warps']} | {setting['num_stages']}{mark} |"
    try:
        errs = [rel(a, b) for a, b in zip(grads(tuning), reference)]
        t = timings(tuning)
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
