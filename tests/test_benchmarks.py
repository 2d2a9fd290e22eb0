"""benchmarks/: the framework's benchmarks run as scripts against the installed packages alone. Each script's --help,
in a child process whose import path holds only what an install of rltrain and rltrain-kernels provides (the
checkout's two package roots), not the kernels' benchmark helpers: a script that imports one of those, or edits
sys.path to reach this checkout, fails here. Their real runs need GPUs (benchmarks/README.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.name for path in (ROOT / "benchmarks").glob("bench_*.py"))


def test_the_framework_benchmarks_are_the_four():
    assert SCRIPTS == ["bench_actor_step.py", "bench_hybrid_policy.py", "bench_multi_gpu.py", "bench_weight_push.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_against_the_installed_packages(script):
    source = (ROOT / "benchmarks" / script).read_text()
    assert "sys.path" not in source, f"{script} edits sys.path: import the installed packages"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT)])}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                            text=True, env=env, cwd=ROOT / "benchmarks", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: "), result.stdout[:500]
