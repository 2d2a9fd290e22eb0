"""Metric sinks (rltrain.tracking): jsonl records, the console progress line, TensorBoard event files read back with
TensorBoard's own reader, a resumed run's rewind (no step logged twice), and the wandb calls (through a stand-in
`wandb` module: the real one needs an account or its offline service, which CI does not run)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from rltrain.tracking import Tracker

TRAIN = {"step": 1, "train/reward_mean": 0.25, "actor/loss": -0.5, "actor/ppo_kl": 0.001, "time/step_s": 1.5,
         "note": "strings are jsonl-only"}
VAL = {"step": 1, "val/reward_mean": 0.4, "val/count": 10}


def test_jsonl_and_console(tmp_path, capsys):
    tracker = Tracker(["console", "jsonl"], str(tmp_path), total_steps=4)
    tracker.log(TRAIN)
    tracker.log(VAL)
    tracker.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [TRAIN, VAL]
    out = capsys.readouterr().out
    assert "[train    1/4]" in out and "reward 0.250" in out and "ETA" in out
    assert "[val  step    1] reward 0.400 (10 prompts)" in out


def test_console_validation_line_with_several_samples(tmp_path, capsys):
    tracker = Tracker(["console"], str(tmp_path), total_steps=4)
    tracker.log({**VAL, "val/n": 4, "val/mean@4": 0.4, "val/pass@1": 0.4, "val/pass@4": 0.75})
    assert "[val  step    1] reward 0.400 pass@4 0.750 (10 prompts × 4)" in capsys.readouterr().out


def test_console_shows_where_the_step_time_went(tmp_path, capsys):
    tracker = Tracker(["console"], str(tmp_path), total_steps=4)
    times = {"time/rollout_s": 12.1, "time/reward_s": 0.25, "time/old_logprob_s": 1.2, "time/ref_s": 0.9,
             "time/update_s": 3.0, "time/weight_sync_s": 0.4}
    tracker.log({**TRAIN, **times})
    tracker.log({**TRAIN, **times, "step": 2, "perf/actor_mfu": 0.4123})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| rollout 12.10s | reward 0.25s | old_lp 1.20s | ref 0.90s | update 3.00s | sync 0.40s")
    assert lines[1].endswith("| sync 0.40s | mfu 41.2%")


def test_tensorboard_event_file(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tracker = Tracker(["tensorboard"], str(tmp_path), total_steps=2)
    tracker.log(TRAIN)
    tracker.log({**TRAIN, "step": 2, "train/reward_mean": 0.75})
    tracker.log(VAL)
    tracker.close()
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not listed
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward_mean", "actor/loss", "val/reward_mean", "val/count"} <= tags
    assert "note" not in tags and "step" not in tags
    rewards = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert rewards == [(1, pytest.approx(0.25)), (2, pytest.approx(0.75))]


def test_a_resumed_run_rewinds_jsonl_and_tensorboard_to_its_checkpoint(tmp_path):
    """A run killed after logging steps 1-3 (the last line cut short by the kill), resumed from the checkpoint of step
    2: metrics.jsonl keeps step 0's validation and steps 1-2 and gets step 3 once, from the resumed run; TensorBoard
    shows step 3's new value only. A run that starts over keeps nothing."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    first = Tracker(["jsonl", "tensorboard"], str(tmp_path), total_steps=4)
    first.log({**VAL, "step": 0})
    for step in (1, 2, 3):
        first.log({**TRAIN, "step": step, "train/reward_mean": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/rew')
    resumed = Tracker(["jsonl", "tensorboard"], str(tmp_path), total_steps=4)
    resumed.rewind(2)
    resumed.log({**TRAIN, "step": 3, "train/reward_mean": 30.0})
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("train/reward_mean")) for r in records] == [(0, None), (1, 1.0), (2, 2.0), (3, 30.0)]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 1.0), (2, 2.0), (3, 30.0)]

    Tracker(["jsonl"], str(tmp_path), total_steps=4).rewind(None)  # trainer.resume=never, or no checkpoint
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_wandb_calls(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))  # stand-in, see module docstring
    tracker = Tracker(["wandb"], str(tmp_path), total_steps=2, project="proj", run_name="run-a",
                      config={"actor": {"lr": 1e-3}})
    tracker.log(TRAIN)
    tracker.close()
    init_call = calls[0]
    assert init_call == ("init", {"project": "proj", "name": "run-a", "config": {"actor": {"lr": 1e-3}},
                                  "dir": str(tmp_path)})
    assert calls[1] == ("log", {k: v for k, v in TRAIN.items() if k != "step"}, 1)
    assert calls[2] == ("finish",)


def test_missing_backend_package_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="trainer.logger lists wandb.*pip install wandb"):
        Tracker(["wandb"], str(tmp_path), total_steps=1)


def test_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="trainer.logger: unknown logger 'mlflow'"):
        Tracker(["mlflow"], str(tmp_path), total_steps=1)


def test_console_shows_tool_calls_in_multi_turn_runs(tmp_path, capsys):
    tracker = Tracker(["console"], str(tmp_path), total_steps=4)
    tracker.log({**TRAIN, "tool/calls_per_episode": 0.4321})
    tracker.log({**VAL, "val/tool/calls_per_episode": 1.0})
    tracker.log({**TRAIN, "step": 2})
    lines = capsys.readouterr().out.splitlines()
    assert " calls 0.43 |" in lines[0]
    assert lines[1] == "[val  step    1] reward 0.400 calls 1.00 (10 prompts)"
    assert "calls" not in lines[2]   # single-turn runs log no tool metrics


def test_console_shows_reward_errors_when_there_are_any(tmp_path, capsys):
    tracker = Tracker(["console"], str(tmp_path), total_steps=4)
    tracker.log({**TRAIN, "reward/errors": 5.0, "reward/timeouts": 2.0, "reward/memory_errors": 0.0,
                 "reward/worker_deaths": 1.0})
    tracker.log({**TRAIN, "step": 2, "reward/errors": 16.0, "reward/timeouts": 0.0})
    tracker.log({**TRAIN, "step": 3, "reward/errors": 0.0, "reward/timeouts": 0.0})
    lines = capsys.readouterr().out.splitlines()
    assert " reward errors 5 (2 timed out, 1 worker died) |" in lines[0]
    assert " reward errors 16 |" in lines[1]
    assert "errors" not in lines[2]
