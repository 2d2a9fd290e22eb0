"""kernels/benchmarks' measuring tools that GPU decisions rest on: the per-kernel dot-precision override (the
bisection of IPLR's bf16 failure, scripts/gpu_check.sh iplr-bf16; the precision settings of the gated delta
product's --accuracy sweep) must change exactly the kernel it names and undo cleanly, and the accuracy measurement
must run. --value-block must force the state passes' launch it names and --set the setting it names, for the bench's
whole process (checked in child processes, so that this one keeps the shipped settings), and an isolated launch
sweep must survive a setting that kills its process.

On the CPU through the Triton interpreter (native on a GPU), at small shapes in bf16.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "kernels" / "benchmarks"))
from delta_rule_bench_common import (  # noqa: E402
    check_overrides_applied,
    force_value_block,
    outputs_and_grads,
    override_dot_precision,
    restore_dot_precision,
)

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


@pytest.fixture
def restore_launchers(monkeypatch):
    """The override patches the launchers' run; put them back after the test."""
    for cls in (JITFunction, InterpretedFunction):
        monkeypatch.setattr(cls, "run", cls.run)


def test_override_changes_only_the_named_kernel(device, restore_launchers):
    tf32 = functools.partial(chunk_iplr_delta_rule, dot="tf32")  # the host's choice, which the override undercuts
    inputs, do = iplr_inputs(device)
    names = ["o", "final_state", "dq", "dk", "dv", "da", "db", "dh0"]
    base = dict(zip(names, outputs_and_grads(tf32, inputs, do)))
    applied = override_dot_precision(["iplr_bwd_query_kernel=bf16"])
    assert applied == set()
    mixed = dict(zip(names, outputs_and_grads(tf32, inputs, do)))
    assert applied == {"iplr_bwd_query_kernel"}
    check_overrides_applied(["iplr_bwd_query_kernel=bf16"], applied)
    # The forward and every other backward kernel are untouched, bit for bit; da and dq come only from the query-side
    # kernel, whose dots now round their operands to bf16.
    for name in ("o", "final_state", "dk", "dv", "db", "dh0"):
        assert torch.equal(mixed[name], base[name]), name
    assert not torch.equal(mixed["da"], base["da"])
    rel = ((mixed["da"].float() - base["da"].float()).norm() / base["da"].float().norm()).item()
    assert rel < 2e-2  # bf16 operand rounding, not garbage
    restore_dot_precision()
    again = outputs_and_grads(tf32, inputs, do)
    assert all(torch.equal(x, y) for x, y in zip(again, base.values()))  # the host's DOT_PREC again


def test_bad_overrides_are_named(restore_launchers):
    with pytest.raises(SystemExit, match="'iplr_bwd_query_kernel=fp8'"):
        override_dot_precision(["iplr_bwd_query_kernel=fp8"])
    with pytest.raises(SystemExit, match="no_such_kernel"):
        check_overrides_applied(["no_such_kernel=bf16"], set())


@pytest.mark.parametrize("regime", ["g = None, β ∈ (0, 2)", "g ~ logsigmoid(N(0,1)), β ∈ (0, 2)"])
def test_gated_delta_product_accuracy_regimes(regime, device):
    """bench_gated_delta_product.py --accuracy's measurement, at a small size: bf16 errors, finite and non-zero."""
    from bench_gated_delta_product import accuracy_errors

    torch.manual_seed(0)
    out_err, grad_err = accuracy_errors(regime, 2, device=device, B=1, T=40, H=1, D=32)
    assert 1e-5 < out_err < 2e-2 and 1e-5 < grad_err < 5e-2


def test_reference_check_and_switches():
    from types import SimpleNamespace

    from delta_rule_bench_common import check_against_reference, switched

    names = ["o", "final_state", "dq", "dh0"]
    ref = [torch.ones(4) for _ in names]
    check_against_reference("within the bars", names, [r * (1 + 1e-3) for r in ref], ref)
    with pytest.raises(SystemExit, match="outputs 6.0e-03"):
        check_against_reference("output over", names, [ref[0] * 1.006] + ref[1:], ref)
    with pytest.raises(SystemExit, match="gradients 2.0e-02"):
        check_against_reference("gradient over", names, ref[:3] + [ref[3] * 1.02], ref)
    module = SimpleNamespace(SWITCH=False)
    with pytest.raises(RuntimeError), switched([(module, "SWITCH", True)]):
        assert module.SWITCH
        raise RuntimeError  # the old value comes back even when the block fails
    assert module.SWITCH is False


def in_a_bench_process(code: str) -> list[str]:
    """The lines `code` prints, run in a child Python with the benchmarks importable: the bench tools set
    process-wide settings of the kernels, which this process must not keep."""
    benchmarks = str(pathlib.Path(__file__).resolve().parents[2] / "kernels" / "benchmarks")
    proc = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, {benchmarks!r})\n{code}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


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


def test_force_value_block():
    """--value-block sets the state passes' value_block for the bench's whole process (a child process here), whose
    launches then take it whatever the program count; a bad mode is named."""
    lines = in_a_bench_process(
        "import torch\n"
        "from delta_rule_bench_common import force_value_block\n"
        "from rltrain_kernels.ops.common import state_pass\n"
        "for mode in ('wide', 'narrow', 'auto'):\n"
        "    force_value_block(mode)\n"
        "    print(state_pass.VALUE_BLOCK, *state_pass.state_launch('state_pass_bwd', 4, 128, 128, "
        "torch.device('cuda'), sm_count=132))")
    assert lines == ["wide state_pass_bwd_wide 128 64", "narrow state_pass_bwd 128 32", "auto state_pass_bwd 128 32"]
    with pytest.raises(SystemExit, match="--value-block 'half'"):
        force_value_block("half")


SWEEP_SCRIPT = '''
import os, sys
import torch
sys.path.insert(0, {benchmarks!r})
from delta_rule_bench_common import sweep_launch
from rltrain_kernels.ops.common.launch import LAUNCH


def grads():
    setting = LAUNCH["wy_fwd"]
    if (setting["num_warps"], setting["num_stages"]) == (8, 1):  # as a CUDA fault ends a process
        sys.stderr.write("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered\\n")
        os._exit(1)
    if (setting["num_warps"], setting["num_stages"]) == (4, 2):
        raise ValueError("out of resources")
    return [torch.ones(2)] * 3


def timings():
    setting = LAUNCH["wy_fwd"]
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
    environment); the setting that kills its process (as an illegal memory access does) gets a row saying so and the
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
    out = getattr(module, launcher_name)(*args, **kwargs, blocks=blocks)
    assert out.shape == ref.shape
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, f"{op} output pass at {blocks}: {err:.1e} from the bench's float64 reference"


def test_set_switches_by_name():
    """The benches' --set MODULE.NAME=VALUE: sets an ops/common or an op module's global to a Python literal for the
    bench's whole process (a child process here), and refuses an unknown module or name and a value of another type,
    naming the argument, before setting anything."""
    from delta_rule_bench_common import apply_switches

    lines = in_a_bench_process(
        "from delta_rule_bench_common import apply_switches\n"
        "from rltrain_kernels.ops.common import state_pass\n"
        "from rltrain_kernels.ops.gated_delta_rule import chunk_fwd\n"
        "apply_switches(['state_pass.NARROW_BV={}', 'gated_delta_rule.chunk_fwd.OUTPUT_BLOCKS=(32, 16)'])\n"
        "print(state_pass.NARROW_BV, chunk_fwd.OUTPUT_BLOCKS)")
    assert lines == ["{} (32, 16)"]
    for bad, words in (("nowhere.X=1", "no switch 'nowhere.X'"), ("state_pass.NOPE=1", "no switch"),
                       ("state_pass.NARROW_BV=1", "is a dict, got int"),
                       ("state_pass.NARROW_BV=yes", "not a Python literal")):
        with pytest.raises(SystemExit, match=words):
            apply_switches([bad])


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
