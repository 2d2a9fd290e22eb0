"""One run per output directory (rltrain/output_dir.py): a second run is refused naming the directory, host and pid
of the holder, a lock left by a killed process is taken over and said so, the trainer takes the lock before anything
else and frees it when its start fails, and what dead runs left half-written is cleared. Two real runs in one
directory (the CLI's exit 2) are in tests/rltrain/test_trainer_e2e.py."""

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import ConfigError
from rltrain.embedded.model import EmbeddedModelConfig, embedded_policy_dir
from rltrain.embedded.task import TaskConfig
from rltrain.output_dir import OutputDirInUse, OutputDirLock, remove_unfinished
from tests.rltrain.tiny_job import tiny_job

ROOT = Path(__file__).resolve().parents[2]


def _hold_lock_in_a_process(output_dir) -> subprocess.Popen:
    """Another process that takes the lock, says so and sleeps."""
    code = ("import sys, time\nfrom rltrain.output_dir import OutputDirLock\nOutputDirLock.acquire(sys.argv[1])\n"
            "print('locked', flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                       os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen([sys.executable, "-c", code, str(output_dir)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


def test_a_second_run_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, caplog):
    holder = _hold_lock_in_a_process(tmp_path)
    try:
        with pytest.raises(OutputDirInUse) as refused:
            OutputDirLock.acquire(tmp_path)
        assert isinstance(refused.value, ConfigError)  # the entry point exits 2
        assert str(refused.value).startswith(f"trainer.output_dir: {str(tmp_path)!r} is in use by another run "
                                             f"(host {socket.gethostname()}, pid {holder.pid}, since ")
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock, the file keeps its record
        holder.wait()
    caplog.set_level(logging.INFO, logger="rltrain")
    lock = OutputDirLock.acquire(tmp_path)
    assert f"took over the lock of {tmp_path} left by a run that is gone (host {socket.gethostname()}, pid " \
           f"{holder.pid}, since " in caplog.text
    lock.release()
    caplog.clear()
    OutputDirLock.acquire(tmp_path).release()  # released normally: nothing to take over
    assert "took over" not in caplog.text


def test_the_trainer_locks_before_any_work_and_unlocks_when_its_start_fails(tmp_path):
    from rltrain.trainer import GRPOTrainer

    lock = OutputDirLock.acquire(tmp_path)
    with pytest.raises(OutputDirInUse):
        GRPOTrainer(tiny_job(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # no warm start, no metrics: nothing touched
    lock.release()
    with pytest.raises(FileNotFoundError, match="model.path"):
        GRPOTrainer(tiny_job(tmp_path, model={"path": str(tmp_path / "missing")}))
    OutputDirLock.acquire(tmp_path).release()  # the failed start released it


def test_unfinished_temporaries_of_dead_runs_are_removed(tmp_path):
    kept = [tmp_path / "checkpoints" / "step_000001", tmp_path / "warmstart" / "0123456789ab"]
    left = [tmp_path / "checkpoints" / ".tmp_step_000002_host_12", tmp_path / "warmstart" / ".tmp_0123456789ab_host_12",
            tmp_path / "warmstart" / "0123456789ab.tmp"]  # the last: the name before temporaries were per run
    for path in kept + left:
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    assert sorted(remove_unfinished(tmp_path)) == sorted(left)
    assert all(path.is_dir() for path in kept) and not any(path.exists() for path in left)


def test_a_warm_start_finished_first_by_another_process_is_used(tmp_path, monkeypatch):
    """Another process completes the same warm start while this one trains its own: this one's save neither fails
    on the taken name nor leaves a temporary behind."""
    import rltrain.embedded.model as embedded

    config = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, head_dim=16, warmstart_steps=0)
    task = TaskConfig(max_operand=9, num_val=8)
    warm_start, calls = embedded.warm_start, []

    def racing_warm_start(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            with monkeypatch.context() as other:
                other.setattr(os, "getpid", lambda: 4_000_000)
                embedded_policy_dir(str(tmp_path), config, task, 0)
        return warm_start(*args, **kwargs)

    monkeypatch.setattr(embedded, "warm_start", racing_warm_start)
    target = embedded_policy_dir(str(tmp_path), config, task, 0)
    assert len(calls) == 2 and (target / "config.json").is_file()
    assert [p.name for p in (tmp_path / "warmstart").iterdir()] == [target.name]
