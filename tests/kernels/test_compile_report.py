"""kernels/benchmarks/compile_report.py: the delta-rule kernels compiled for sm_90 on a machine without a GPU.

Runs the script in a subprocess (the test session itself runs Triton through the interpreter, which the report
cannot use) at a small shape with the installed Triton, whose wheel ships ptxas and cuobjdump.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernels" / "benchmarks" / "compile_report.py"


def run_report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_report_lists_every_launch_of_a_forward_and_backward(tmp_path):
    result = run_report("--B", "1", "--T", "100", "--H", "2", "--D", "32", "--launch", "wy_bwd=8,1",
                        "--value-block", "narrow", "--asm", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()
            if line.startswith("| ") and "_kernel" in line]
    names = [row[0].strip() for row in rows]
    # the backward recomputes the states from the stored T (no WY launch) and, in the narrow launch that 2
    # sequence-heads take, forms Pᵀ dO in local_dv_kernel first
    assert names == ["chunk_local_cumsum_kernel", "gated_wy_fwd_kernel", "state_pass_fwd_kernel",
                     "chunk_output_fwd_kernel", "state_pass_fwd_kernel", "local_dv_kernel",
                     "state_pass_bwd_kernel", "chunk_dqkwg_kernel", "gated_wy_bwd_kernel",
                     "chunk_local_cumsum_kernel"]
    for row in rows:
        grid, warps, stages, regs, spilled, shared = (cell.strip() for cell in row[1:7])
        assert re.fullmatch(r"\(\d+(, \d+)*,?\)", grid) and 0 < int(regs) <= 255 and int(spilled) >= 0
        assert float(shared) > 0
    wy_bwd = rows[names.index("gated_wy_bwd_kernel")]
    assert (wy_bwd[2].strip(), wy_bwd[3].strip()) == ("8", "1")  # the --launch override took effect
    assert "sm_90" in result.stdout
    # --asm: each launch's IR, PTX and SASS, numbered in launch order
    state_pass = tmp_path / "03_state_pass_fwd_kernel"
    assert "scf.for" in state_pass.with_suffix(".ttgir").read_text()
    assert ".target sm_90a" in state_pass.with_suffix(".ptx").read_text()
    sass = state_pass.with_suffix(".sass").read_text()
    assert "HGMMA" in sass or "HMMA" in sass  # its dots, on the tensor cores
    assert len(list(tmp_path.glob("*.sass"))) == len(rows)


def test_report_rejects_an_unknown_launch_entry():
    result = run_report("--launch", "no_such_kernel=4,2")
    assert result.returncode != 0
    assert "--launch 'no_such_kernel=4,2'" in result.stderr and "wy_bwd" in result.stderr
    result = run_report("--value-block", "half")
    assert result.returncode != 0 and "Tuning.value_block must be one of auto, wide, narrow" in result.stderr


def test_report_compiles_the_kda_kernels():
    """--op kda: Kimi Delta Attention's chunk kernels (a decay per key channel), forward and backward, each compiled
    for sm_90 with its resources, a --launch entry of KDA's taking effect."""
    result = run_report("--op", "kda", "--B", "1", "--T", "100", "--H", "2", "--D", "32", "--launch", "kda_dqk=8,1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()
            if line.startswith("| ") and "_kernel" in line]
    names = [row[0].strip() for row in rows]
    # the backward recomputes the states (kda_state_fwd_kernel again) from the forward's stored solve
    assert names == ["kda_gate_cumsum_kernel", "kda_intra_fwd_kernel", "kda_solve_kernel", "kda_gated_keys_kernel",
                     "kda_state_fwd_kernel", "kda_output_fwd_kernel", "kda_gated_keys_kernel", "kda_state_fwd_kernel",
                     "kda_state_bwd_kernel", "kda_dv_kernel", "kda_dqk_kernel", "kda_intra_bwd_kernel",
                     "kda_gate_bwd_kernel"]
    for row in rows:
        grid, warps, stages, regs, spilled, shared = (cell.strip() for cell in row[1:7])
        assert re.fullmatch(r"\(\d+(, \d+)*,?\)", grid) and 0 < int(regs) <= 255 and int(spilled) >= 0
        if "gated_keys" not in row[0]:  # the kernels with dots stage operands in shared memory; elementwise ones none
            assert float(shared) > 0
    dqk = rows[names.index("kda_dqk_kernel")]
    assert (dqk[2].strip(), dqk[3].strip()) == ("8", "1")
    assert "sm_90, kda bfloat16" in result.stdout
