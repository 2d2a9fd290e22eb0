"""kernels/benchmarks' measuring tools that GPU decisions rest on: a bench's command line becomes the ops' `tuning`
argument (ops/common/tuning.py), whose per-kernel dot precision (the bisection of IPLR's bf16 failure,
scripts/gpu_check.sh iplr-bf16) must change exactly the kernel it names, and whose value block must force the state
passes' launch it names; a bad flag is named. The accuracy measurement must run, and an isolated launch sweep must
survive a setting that kills its process.

On the CPU through the Triton interpreter (native on a GPU), at small shapes in bf16.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "kernels" / "benchmarks"))
from delta_rule_bench_common import (  # noqa: E402
    add_tuning_arguments,
    outputs_and_grads,
    tuning_from_args,
)

from rltrain_kernels.ops.common.tuning import Tuning  # noqa: E402
from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule  # noqa: E402


def iplr_inputs(device):
    torch.manual_seed(0)
    B, T, H, D = 1, 100, 1, 32
    q, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    a = -0.5 * torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    b = -2 * a
    inputs = [x.to(device, torch.bfloat16) for x in (q, k, v, a, b)] + [torch.randn(B, H, D, D, device=device)]
    return inputs, torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)


def bench_args(*argv: str) -> argparse.Namespace:
    """A bench's parsed arguments: the shared tuning options, --output-blocks and --dot-per-kernel (as the IPLR
    bench has them)."""
    parser = argparse.ArgumentParser()
    add_tuning_arguments(parser, "wy_bwd=8,2", "sweep", "value block")
    parser.add_argument("--output-blocks")
    parser.add_argument("--dot-per-kernel", nargs="*", default=[])
    return parser.parse_args(argv)


def test_dot_per_kernel_changes_only_the_named_kernel(device):
    """--dot-per-kernel KERNEL=bf16 under the op's tf32 dots: the Tuning it makes gives the query-side backward kernel
    bf16 dots, and nothing else changes; the next call without it computes the host's numbers again."""
    tf32 = functools.partial(chunk_iplr_delta_rule, dot="tf32")  # the host's choice, which the override undercuts
    inputs, do = iplr_inputs(device)
    names = ["o", "final_state", "dq", "dk", "dv", "da", "db", "dh0"]
    base = dict(zip(names, outputs_and_grads(tf32, inputs, do)))
    tuning = tuning_from_args(bench_args("--dot-per-kernel", "iplr_bwd_query_kernel=bf16"))
    assert tuning == Tuning(dots={"iplr_bwd_query_kernel": "bf16"})
    mixed = dict(zip(names, outputs_and_grads(functools.partial(tf32, tuning=tuning), inputs, do)))
    # The forward and every other backward kernel are untouched, bit for bit; da and dq come only from the query-side
    # kernel, whose dots now round their operands to bf16.
    for name in ("o", "final_state", "dk", "dv", "db", "dh0"):
        assert torch.equal(mixed[name], base[name]), name
    assert not torch.equal(mixed["da"], base["da"])
    rel = ((mixed["da"].float() - base["da"].float()).norm() / base["da"].float().norm()).item()
    assert rel < 2e-2  # bf16 operand rounding, not garbage
    again = outputs_and_grads(tf32, inputs, do)
    assert all(torch.equal(x, y) for x, y in zip(again, base.values()))  # the host's DOT_PREC again


def test_tuning_from_args():
    """Each flag lands in its Tuning field; the defaults make the shipped Tuning."""
    assert tuning_from_args(bench_args()) == Tuning()
    tuning = tuning_from_args(bench_args("--launch", "wy_bwd=8,2", "iplr_bwd_key=4,1", "--value-block", "narrow",
                                         "--output-blocks", "128,64"))
    assert tuning == Tuning(launches={"wy_bwd": (8, 2), "iplr_bwd_key": (4, 1)}, value_block="narrow",
                            output_blocks=(128, 64))
    assert tuning.launch("wy_bwd") == dict(num_warps=8, num_stages=2)


@pytest.mark.parametrize("argv, words", [
    (("--launch", "no_such=4,2"), "--launch 'no_such=4,2'"),
    (("--launch", "wy_bwd=8"), "expected NAME=WARPS,STAGES"),
    (("--launch", "wy_bwd=0,2"), "must be (warps, stages)"),
    (("--output-blocks", "64,48"), "--output-blocks '64,48'"),
    (("--dot-per-kernel", "iplr_bwd_query_kernel=fp8"), "'iplr_bwd_query_kernel=fp8'"),
    (("--dot-per-kernel", "no_such_kernel=bf16"), "no_such_kernel"),
], ids=["launch-name", "launch-form", "launch-zero", "output-blocks", "dot-precision", "dot-kernel"])
def test_bad_flags_are_named(argv, words):
    with pytest.raises(SystemExit, match=re.escape(words)):
        tuning_from_args(bench_args(*argv))


@pytest.mark.parametrize("regime", ["g = None, β ∈ (0, 2)", "g ~ logsigmoid(N(0,1)), β ∈ (0, 2)"])
def test_gated_delta_product_accuracy_regimes(regime, device):
    """bench_gated_delta_product.py --accuracy's measurement, at a small size: bf16 errors, finite and non-zero."""
    from bench_gated_delta_product import accuracy_errors

    torch.manual_seed(0)
    out_err, grad_err = accuracy_errors(regime, 2, device=device, B=1, T=40, H=1, D=32)
    assert 1e-5 < out_err < 2e-2 and 1e-5 < grad_err < 5e-2


def test_reference_check():
    from delta_rule_bench_common import check_against_reference

    names = ["o", "final_state", "dq", "dh0"]
    ref = [torch.ones(4) for _ in names]
    check_against_reference("within the bars", names, [r * (1 + 1e-3) for r in ref], ref)
    with pytest.raises(SystemExit, match="outputs 6.0e-03"):
        check_against_reference("output over", names, [ref[0] * 1.006] + ref[1:], ref)
    with pytest.raises(SystemExit, match="gradients 2.0e-02"):
        check_against_reference("gradient over", names, ref[:3] + [ref[3] * 1.02], ref)


@pytest.mark.parametrize("mode", ["wide", "narrow"])
def test_state_launch_value_block(mode):
    """state_launch's value_block wide/narrow (--value-block's setting): the *_wide LAUNCH entries (BV=64) or the
    narrow ones (BV=32) whatever the program count; auto leaves the occupancy rule (as on an H100: 132 SMs)."""
    from rltrain_kernels.ops.common import state_pass

    def launch(programs, value_block):
        return state_pass.state_launch("state_pass_bwd", programs, 128, 128, torch.device("cuda"), sm_count=132,
                                       value_block=value_block)
    assert launch(1, "auto")[2] == 32 and launch(4096, "auto")[2] == 64   # too few programs, then enough
    for programs in (1, 4096):
        assert launch(programs, mode) == (("state_pass_bwd_wide", 128, 64) if mode == "wide"
                                          else ("state_pass_bwd", 128, 32))


WIDE, NARROW = {"fwd": 64, "bwd": 64}, {"fwd": 16, "bwd": 32}  # the state passes' value columns (NARROW_BV)


@pytest.mark.parametrize("value_block, sm_count, columns", [("auto", 1, WIDE), ("auto", 132, NARROW),
                                                            ("narrow", 1, NARROW), ("wide", 132, WIDE)],
                         ids=["auto-1-SM", "auto-132-SMs", "narrow-1-SM", "wide-132-SMs"])
def test_value_block_reaches_the_state_passes(value_block, sm_count, columns, device, monkeypatch):
    """--value-block and the SM count the occupancy rule plans for reach the state passes' launches through the op's
    tuning, forward and backward: one sequence-head fills one SM (wide) but not 132 (narrow), and wide / narrow hold
    whatever the count."""
    import dataclasses

    from rltrain_kernels.ops.common import state_pass
    from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    from tests.helpers import spy_launches

    tuning = dataclasses.replace(tuning_from_args(bench_args("--value-block", value_block)), sm_count=sm_count)
    seen = {}
    for name, key in (("state_pass_fwd_kernel", "fwd"), ("state_pass_bwd_kernel", "bwd")):
        spy_launches(monkeypatch, state_pass, name, lambda args, kwargs, key=key: seen.setdefault(key, kwargs["BV"]))
    q, k, v = (torch.randn(1, 64, 1, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 1, device=device)).requires_grad_()
    beta = torch.rand(1, 64, 1, device=device, requires_grad=True)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, tuning=tuning)
    o.float().sum().backward()
    assert seen == columns


SWEEP_SCRIPT = '''
import os, sys
import torch
sys.path.insert(0, {benchmarks!r})
from delta_rule_bench_common import sweep_launch


def grads(tuning):
    setting = tuning.launch("wy_fwd")
    if (setting["num_warps"], setting["num_stages"]) == (8, 1):  # as a CUDA fault ends a process
        sys.stderr.write("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered\\n")
        os._exit(1)
    if (setting["num_warps"], setting["num_stages"]) == (4, 2):
        raise ValueError("out of resources")
    return [torch.ones(2)] * 3


def timings(tuning):
    setting = tuning.launch("wy_fwd")
    return float(setting["num_warps"]), float(setting["num_stages"]) / 10


sweep_launch(["wy_fwd"], grads, [torch.ones(2)] * 3, timings, "fake", warps_options=(4, 8), isolate={isolate})
'''


def fake_sweep(tmp_path, isolate: bool):
    benchmarks = str(pathlib.Path(__file__).resolve().parents[2] / "kernels" / "benchmarks")
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT.format(benchmarks=benchmarks, isolate=isolate))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_isolated_sweep_survives_a_fault(tmp_path):
    """--isolate: each warps × stages setting in its own process (this script again, one setting named in the
    environment, passed to grads and timings as a Tuning); the setting that kills its process (as an illegal memory access does) gets a row saying so and the
    sweep goes on; an exception stays a row; every other row carries what its child measured, the shipped setting
    marked."""
    proc = fake_sweep(tmp_path, isolate=True)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| wy_fwd |")]
    assert len(rows) == 6
    assert "| wy_fwd | 8 | 1 | child process failed: RuntimeError: Triton Error [CUDA]: an illegal memory access" in (
        rows[3])
    assert rows[1] == "| wy_fwd | 4 | 2 | ValueError | | | |"
    assert rows[2] == "| wy_fwd | 4 | 3 (default) | 0.0e+00 | 0.0e+00 | 4.000 | 0.300 |"
    assert rows[5] == "| wy_fwd | 8 | 3 | 0.0e+00 | 0.0e+00 | 8.000 | 0.300 |"


def test_sweep_without_isolation_dies_with_its_fault(tmp_path):
    """The in-process sweep (the default) ends at the fault: the reason --isolate exists."""
    proc = fake_sweep(tmp_path, isolate=False)
    assert proc.returncode == 1
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| wy_fwd |")]
    assert len(rows) == 3 and "illegal memory access" in proc.stderr


@pytest.mark.parametrize("op", ["gated_delta_rule", "iplr_delta_rule"])
@pytest.mark.parametrize("blocks", [(32, 32), (16, 32)], ids=["blocks32x32", "blocks16x32"])
def test_output_blocks_bench_reference_matches_the_kernels(op, blocks, device):
    """bench_output_blocks.py's float64 evaluation of each output pass (what it checks every tile setting against)
    agrees with the kernels at bf16 accuracy, through the launcher's blocks at two settings (BK < K: the key loop)."""
    import importlib

    from bench_output_blocks import OPS, make_case

    module_name, launcher_name, _ = OPS[op]
    module = importlib.import_module(module_name)
    torch.manual_seed(0)
    args, kwargs, ref = make_case(op, 2, 128, 2, 32, device=device)
    out = getattr(module, launcher_name)(*args, **kwargs, tuning=Tuning(output_blocks=blocks))
    assert out.shape == ref.shape
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, f"{op} output pass at {blocks}: {err:.1e} from the bench's float64 reference"


def test_profile_helper_runs_each_implementation_once_per_step(monkeypatch):
    """kernel_profile.print_fwd_bwd_kernel_times (the delta-rule benches' --profile): one labelled profile per present
    implementation, its step a forward+backward on the shared leaves with their gradients cleared first (a gradient
    accumulated across the profiler's warm-up calls would show here as a multiple)."""
    import kernel_profile

    profiled = []

    def fake_print(label, step, top=10):
        for _ in range(3):  # the warm-ups and the profiled call
            step()
        profiled.append((label, x.grad.clone()))

    monkeypatch.setattr(kernel_profile, "print_kernel_times", fake_print)
    x = torch.randn(4, requires_grad=True)
    do = torch.randn(4)
    double = lambda t: (2 * t,)  # noqa: E731
    kernel_profile.print_fwd_bwd_kernel_times("fwd+bwd", (("ours", double), ("peer", None)), [x],
                                              lambda fn: fn(x), do)
    assert [label for label, _ in profiled] == ["ours fwd+bwd"]
    assert torch.equal(profiled[0][1], 2 * do)
