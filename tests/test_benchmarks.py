"""benchmarks/: the framework's benchmarks run as scripts against the installed packages alone. Each script's --help,
in a child process whose import path holds only what an install of rltrain and rltrain-kernels provides (the
checkout's two package roots), not the kernels' benchmark helpers: a script that imports one of those, or edits
sys.path to reach this checkout, fails here. Their real runs need GPUs (benchmarks/README.md); the whole-step
benchmark's CPU dry run runs here too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.name for path in (ROOT / "benchmarks").glob("bench_*.py"))


def test_the_framework_benchmarks_are_the_seven():
    assert SCRIPTS == ["bench_actor_step.py", "bench_agentic_rollout.py", "bench_hybrid_policy.py",
                       "bench_multi_gpu.py", "bench_parallel_layouts.py", "bench_rl_step.py", "bench_weight_push.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_against_the_installed_packages(script):
    source = (ROOT / "benchmarks" / script).read_text()
    assert "sys.path" not in source, f"{script} edits sys.path: import the installed packages"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT)])}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                            text=True, env=env, cwd=ROOT / "benchmarks", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: "), result.stdout[:500]


def test_the_whole_step_benchmark_runs_the_trainer_on_cpu():
    """bench_rl_step.py's dry run: the trainer's two steps on a tiny checkpoint it builds (tokenizer included), the
    phase table and the goals' lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT)])}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rl_step.py"), "--tiny", "--device", "cpu"],
                            capture_output=True, text=True, env=env, cwd=ROOT / "benchmarks", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    seconds = {}
    for phase in ("rollout", "reward", "old_logprob", "ref", "update", "weight_sync", "step"):
        row = next(line for line in lines if line.startswith(f"| {phase} |"))
        seconds[phase] = float(row.split("|")[2])
    assert seconds["rollout"] > 0 and seconds["update"] > 0 and seconds["step"] >= seconds["update"], seconds
    assert any(line.startswith("everything but rollout and update:") for line in lines), result.stdout
