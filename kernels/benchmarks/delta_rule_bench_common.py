"""What the delta-rule benchmarks share: the error measure, outputs and gradients of an op for a check, and the
launch settings (ops/common/launch.py's LAUNCH table) from the command line: `--launch NAME=WARPS,STAGES` overrides
and the `--sweep-launch` loop (every warps × stages of the named entries, each checked against a reference before it
is timed). Imported by the bench scripts and compile_report.py beside it.
"""

from __future__ import annotations

from collections.abc import Callable


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(fn, inputs, do) -> list:
    """[o, final state, then the gradient of every input] of fn on fresh leaf copies of `inputs` (the op's five
    tensors, then the initial state), for the loss ⟨o, do⟩ + Σ final state."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    o, ht = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    (o.float() * do.float()).sum().add(ht.sum()).backward()
    return [o, ht] + [t.grad for t in inputs]


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


def sweep_launch(names: list[str], grads: Callable[[], list], reference: list, time_fwd_bwd: Callable[[], float],
                 label: str) -> None:
    """For each LAUNCH entry in `names`, every (warps, stages) in {2, 4, 8} × {1, 2, 3}: the worst relative error of
    grads() (outputs first two, then gradients) against `reference`, then time_fwd_bwd() in ms, one table row each.
    A setting that raises (out of shared memory, say) gets its exception's name and the sweep goes on; an illegal
    memory access ends the process's CUDA context, so sweep suspected settings one process at a time (--launch)."""
    from rltrain_kernels.ops.common.launch import LAUNCH

    print(f"| kernel | warps | stages | worst output err | worst grad err | fwd+bwd ms ({label}) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for name in names:
        if name not in LAUNCH:
            raise SystemExit(f"--sweep-launch {name!r}: not an entry of ops/common/launch.py ({sorted(LAUNCH)})")
        default = dict(LAUNCH[name])
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                LAUNCH[name] = dict(num_warps=warps, num_stages=stages)
                mark = " (default)" if LAUNCH[name] == default else ""
                try:
                    errs = [rel(a, b) for a, b in zip(grads(), reference)]
                    t = time_fwd_bwd()
                except Exception as exc:  # noqa: BLE001 - reported in the table, the sweep goes on
                    print(f"| {name} | {warps} | {stages}{mark} | {type(exc).__name__} | | |", flush=True)
                    continue
                print(f"| {name} | {warps} | {stages}{mark} | {max(errs[:2]):.1e} | {max(errs[2:]):.1e} | {t:.3f} |",
                      flush=True)
        LAUNCH[name] = default
