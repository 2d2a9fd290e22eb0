"""Asynchronous RL (trainer.mode, rltrain/async_rollout.py). The producer on its own, with stand-ins for the engines:
one_step_off samples step t's batch by exactly version t − 2, async by one at most k versions old, the queue stays
within k, a weight load never overlaps a generation, validation gets the newest weights between batches, errors reach
the trainer. Then through the real trainer (Ray actors on 2 CPUs, rollout.placement=separate: one CPU each):
one_step_off (with AReaL's decoupled objective) and async k=2 (old log-probs from the engine, TIS) train the embedded
default end to end with the lags the modes promise, read back from metrics.jsonl, the rollout on a CPU of its own; a
run SIGKILLed mid-way resumes, dropping its queue with a log line.

    .venv/bin/python -m pytest tests/rltrain/test_async.py -x -q     # about 2 minutes on 2 cores
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch
from tensordict import TensorDict

from rltrain import trainer as trainer_module
from rltrain.async_rollout import ProducedBatch, RolloutProducer, check_lag, dropped_on_resume
from rltrain.checkpoint import latest_checkpoint
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.trainer import GRPOTrainer
from tests.rltrain.test_trainer_e2e import _overrides
from tests.rltrain.tiny_job import compose, merge, metric_records, tiny_job

ROOT = Path(__file__).resolve().parents[2]


class FakeEngines:
    """Stand-ins for the rollout side: generate(step) sleeps a random while and records which version the engines
    held; a load or a generation that overlaps another fails."""

    def __init__(self, seconds: float, seed: int = 0, held: int = 0):
        self.busy, self.held, self.seconds = threading.Lock(), held, seconds
        self.random = random.Random(seed)
        self.generated: dict[int, int] = {}

    @contextmanager
    def _exclusive(self):
        if not self.busy.acquire(blocking=False):
            raise AssertionError("a weight load or generation overlapped another")
        try:
            yield
        finally:
            self.busy.release()

    def generate(self, step: int) -> ProducedBatch:
        with self._exclusive():
            time.sleep(self.random.uniform(0, self.seconds))
            self.generated[step] = self.held
        batch = TensorDict({"rewards": torch.zeros(4)}, batch_size=[4])
        return ProducedBatch(step, batch, [], 0, 1, {"rollout": 0.0}, {}, {"index": step})

    def load(self, snapshot, version: int) -> float:
        assert snapshot == version   # _train publishes each version's number as its snapshot
        with self._exclusive():
            time.sleep(self.random.uniform(0, self.seconds / 4))
            self.held = snapshot
        return 0.0


def _train(producer: RolloutProducer, engines: FakeEngines, steps: range, train_s: float, seed: int = 1,
           validate_every: int = 0) -> dict[int, int]:
    """The trainer's side: take each step's batch, 'train' a random while, publish the next version (the
    snapshot is the version number itself); every validate_every steps run a generation on the newest weights.
    Returns {step: version that sampled its batch}."""
    rng, versions, sizes = random.Random(seed), {}, []
    for step in steps:
        item = producer.take(step)
        versions[step] = item.version
        assert engines.generated[step] == item.version and item.batch["weight_version"].tolist() == [item.version] * 4
        time.sleep(rng.uniform(0, train_s))
        sizes.append(len(producer.pending()))
        producer.publish(step, step)
        if validate_every and step % validate_every == 0:
            assert producer.with_weights(step, lambda: engines.held) == step
    producer.stop()
    assert max(sizes) <= producer.bound, sizes
    return versions


@pytest.mark.parametrize("rollout_s, train_s", [(0.02, 0.0), (0.0, 0.02), (0.01, 0.01)],
                         ids=["rollout-slower", "actor-slower", "even"])
def test_one_step_off_samples_each_step_with_the_weights_two_steps_back(rollout_s, train_s):
    engines = FakeEngines(rollout_s)
    producer = RolloutProducer(engines.generate, engines.load, range(1, 13), 0, "one_step_off", 1).start()
    versions = _train(producer, engines, range(1, 13), train_s, validate_every=4)
    assert versions == {step: max(0, step - 2) for step in range(1, 13)}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("rollout_s, train_s", [(0.02, 0.0), (0.0, 0.02), (0.01, 0.01)],
                         ids=["rollout-slower", "actor-slower", "even"])
def test_async_lag_stays_within_max_staleness(k, rollout_s, train_s):
    engines = FakeEngines(rollout_s, seed=k, held=4)
    producer = RolloutProducer(engines.generate, engines.load, range(5, 25), 4, "async", k).start()  # resumed at 4
    versions = _train(producer, engines, range(5, 25), train_s, seed=k, validate_every=3)
    lags = [step - 1 - version for step, version in versions.items()]
    assert all(0 <= lag <= k for lag in lags), versions
    assert versions[5] == 4  # the first batch after a resume: the checkpoint's weights
    if train_s > rollout_s:  # the actor is the bottleneck: the producer runs as far ahead as k lets it
        assert max(lags) == k, versions


def test_producer_errors_reach_the_trainer():
    def generate(step):
        raise ValueError("engine died")

    producer = RolloutProducer(generate, lambda snapshot, version: 0.0, range(1, 3), 0, "async", 2).start()
    with pytest.raises(RuntimeError, match="rollout producer failed") as err:
        producer.take(1)
    assert isinstance(err.value.__cause__, ValueError)


def test_take_beyond_the_last_step_says_so():
    engines = FakeEngines(0.0)
    producer = RolloutProducer(engines.generate, engines.load, range(1, 2), 0, "async", 1).start()
    assert producer.take(1).step == 1
    with pytest.raises(RuntimeError, match="stopped before step 2's batch"):
        producer.take(2)


def test_check_lag_enforces_each_mode():
    versions = torch.tensor([2, 2, 3])
    assert check_lag("async", 2, 5, 0, versions).tolist() == [2, 2, 1]
    with pytest.raises(RuntimeError, match=r"trainer.mode=async: step 6 .* lags \[2, 3\]; the mode allows lags in "
                                           r"\[0, 2\]"):
        check_lag("async", 2, 6, 0, versions)
    assert check_lag("one_step_off", 1, 4, 0, torch.tensor([2, 2])).tolist() == [1, 1]
    assert check_lag("one_step_off", 1, 4, 3, torch.tensor([3])).tolist() == [0]  # first step after a resume
    with pytest.raises(RuntimeError, match="allows lags exactly 1"):
        check_lag("one_step_off", 1, 4, 0, torch.tensor([3]))
    assert check_lag("sync", 1, 4, 0, torch.tensor([3, 3])).tolist() == [0, 0]
    with pytest.raises(RuntimeError, match=r"allows lags in \[0, 0\]"):
        check_lag("sync", 1, 4, 0, torch.tensor([2]))


def test_dropped_on_resume_says_how_many_groups():
    state = {"step": 6, "mode": "async", "pending": {"7": 16, "8": 16, "9": -1}}
    assert dropped_on_resume(state, 4) == (
        "resume: the checkpoint of step 6 (trainer.mode=async) had 8 scored group(s) queued (steps [7, 8]), and step "
        "9's batch was being generated; dropped: this run generates those steps again, from the same prompts, on the "
        "checkpoint's weights")


# ---------------------------------------------------------------- through the real trainer
@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()



def _reward_plugin(tmp_path) -> dict:
    """A reward 0 or 1 about evenly over responses, so advantages are nonzero and the weights move every step."""
    plugin = tmp_path / "reward.py"
    plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    return {"path": str(plugin), "name": "score"}


def _processes_placement_groups(handles) -> list[str]:
    return ray.get([h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_placement_group_id())
                    for h in handles])


@pytest.mark.parametrize("mode, k, algorithm", [
    ("one_step_off", 1, {"loss": {"decoupled": True}}),
    ("async", 2, {"old_logprobs": "rollout", "rollout_correction": {"mode": "truncate", "high": 1.5}}),
], ids=["one_step_off-decoupled", "async-2-rollout-old-logprobs"])
def test_modes_train_end_to_end_with_bounded_lag(tmp_path, ray_session, mode, k, algorithm):
    """The embedded default (tiny) for 5 steps: the rollout on a CPU of its own; the lags in metrics.jsonl are the
    mode's (one_step_off: 0 then exactly 1; async: within k, reaching it). The engine reports the behaviour policy's
    log-probs: with the actor's recomputed old log-probs (decoupled) they differ once the sampling weights are a
    version behind, and AReaL's weights π_prox/π_behaviour move off 1; with algorithm.old_logprobs=rollout they are
    the old log-probs (no recompute, ratios 1)."""
    out = tmp_path / "run"
    # four passes over each batch: the update outlasts generating and scoring the next, so an async producer fills
    # its queue and the lag reaches k whatever the machine's load
    job = tiny_job(out, trainer={"total_steps": 5, "mode": mode, "max_staleness": k, "val_every": 2},
                   rollout={"placement": "separate", "temperature": 1.5}, reward=_reward_plugin(tmp_path),
                   algorithm=algorithm, actor={"ppo_epochs": 4})
    trainer = GRPOTrainer(job)
    try:
        actor_group, = _processes_placement_groups([trainer.actor])
        rollout_groups = _processes_placement_groups(trainer.rollout.processes)
        assert rollout_groups == [trainer.rollout_placement.groups[0].id.hex()] != [actor_group]
        assert ray.get(trainer.rollout.processes[0].__ray_call__.remote(lambda self: torch.get_num_threads())) == 1
        result = trainer.fit()
        # the final validation ran on the last version: the engine holds the actor's weights, loaded from a snapshot
        engine = ray.get(trainer.rollout.processes[0].__ray_call__.remote(lambda self: self.engine.model.state_dict()))
        actor = ray.get(trainer.actor.state_dict.remote())
        assert engine.keys() == actor.keys() and all(torch.equal(engine[name], actor[name]) for name in actor)
    finally:
        trainer.close()
    assert result["step"] == 5
    records = metric_records(out)
    train = {r["step"]: r for r in records if "train/reward_mean" in r}
    assert [r["step"] for r in records if "val/reward_mean" in r] == [0, 2, 4, 5]
    lags = [train[s]["rollout/version_lag_max"] for s in range(1, 6)]
    assert all(train[s]["rollout/version_lag_mean"] == lags[s - 1] for s in range(1, 6))  # one version per batch
    if mode == "one_step_off":
        assert lags == [0, 1, 1, 1, 1]
    else:
        assert lags[0] == 0 and max(lags) == k and all(0 <= lag <= k for lag in lags), lags
    for step, record in train.items():
        assert record["actor/grad_norm"] > 0 and "time/rollout_wait_s" in record
        stale = record["rollout/version_lag_max"] > 0
        if algorithm.get("old_logprobs") == "rollout":  # taken from the batch: no actor pass
            assert record["rollout/kl"] == 0 and record["rollout/is_ratio_max"] == 1.0
            assert record["time/old_logprob_s"] < 0.01
        else:  # fp32 recompute of the same weights: ~1e-14
            assert (record["rollout/kl"] > 1e-8) == stale, (step, record["rollout/kl"])
            assert (abs(record["rollout/is_weight_mean"] - 1) > 1e-6) == stale, (step, record)


def _timed(events: list, name: str, method):
    """method, appending (name, its thread's name, start, end) to events at each call."""
    def timed(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return method(self, *args, **kwargs)
        finally:
            events.append((name, threading.current_thread().name, start, time.monotonic()))
    return timed


def test_scoring_overlaps_the_next_rollout_and_trains_the_same(tmp_path, ray_session, monkeypatch):
    """one_step_off: a batch's scoring (a reward function slow enough to be the producer's bottleneck) runs on the
    scoring thread while the producer generates the next batch, and the run trains exactly as it does with each batch
    scored before the next rollout (one_step_off replays exactly)."""
    plugin = tmp_path / "slow.py"
    plugin.write_text("import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(0.05)\n    return float(sum(map(ord, solution_str)) % 2)\n")

    def train(name: str, overlapped: bool) -> tuple[list, dict]:
        events = []
        with monkeypatch.context() as patch:
            patch.setattr(GRPOTrainer, "_generate", _timed(events, "generate", GRPOTrainer._generate))
            patch.setattr(GRPOTrainer, "_score", _timed(events, "score", GRPOTrainer._score))
            if not overlapped:   # no scoring thread: the producer scores each batch itself
                patch.setattr(trainer_module, "ThreadPoolExecutor", lambda *args, **kwargs: None)
            job = tiny_job(tmp_path / name, trainer={"total_steps": 4, "mode": "one_step_off"},
                           reward={"path": str(plugin), "name": "score"})
            assert run(job)["step"] == 4
        return events, {r["step"]: r for r in metric_records(tmp_path / name) if "train/reward_mean" in r}

    events, overlapped = train("overlapped", True)
    rollouts = [start for name, thread, start, _ in events if name == "generate" and thread == "rollout-producer"]
    scorings = [(start, end) for name, thread, start, end in events if name == "score" and thread.startswith("scoring")]
    assert len(rollouts) == len(scorings) == 4
    assert sum(start < rollout < end for start, end in scorings for rollout in rollouts) >= 2, events
    events, alone = train("alone", False)
    assert [thread for name, thread, *_ in events if name == "score"].count("rollout-producer") == 4
    for step, record in alone.items():
        for key in ("train/reward_mean", "actor/grad_norm", "actor/loss"):
            assert overlapped[step][key] == record[key], (step, key)
        assert overlapped[step]["time/reward_s"] > 0.5   # the step's record still says how long it was scored


def test_killed_async_run_resumes_and_drops_its_queue(tmp_path, ray_session, caplog):
    """`python -m rltrain.main_grpo trainer.mode=async trainer.max_staleness=2`, SIGKILLed with its process group
    once step 2's checkpoint is written; resume=auto continues after the newest checkpoint: the log line says the
    queue was dropped, the first resumed step samples on the checkpoint's weights (lag 0) and the lags stay <= 2.
    The checkpoint's sampler position is the last trained batch's, not the producer's (which ran ahead), so the
    dropped steps' prompts are generated again."""
    out = tmp_path / "run"
    sections = dict(trainer={"mode": "async", "max_staleness": 2, "save_every": 1}, rollout={"placement": "separate"},
                    reward=_reward_plugin(tmp_path))
    command = [sys.executable, "-m", "rltrain.main_grpo",
               *_overrides(out, **merge(sections, {"trainer": {"total_steps": 60},
                                                   "ray": {"address": "local", "num_cpus": 2}})),
               f"hydra.run.dir={tmp_path / 'hydra'}"]
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not (out / "checkpoints" / "step_000002" / "trainer_state.json").is_file():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    newest = latest_checkpoint(str(out))
    last = int(newest.name.removeprefix("step_"))
    saved = json.loads((newest / "trainer_state.json").read_text())
    assert saved["mode"] == "async" and saved["pending"], saved  # the producer was ahead when it saved
    assert saved["sampler"] == {"epoch": 0, "index": last * 4}  # data.batch_size 4 prompts per trained step

    job = load_job_config(compose(*_overrides(out, **merge(sections, {"trainer": {"total_steps": last + 4}}))))
    trainer = GRPOTrainer(job)
    try:
        with caplog.at_level("WARNING", logger="rltrain.trainer"):
            result = trainer.fit()
    finally:
        trainer.close()
    assert result["step"] == last + 4
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].startswith(f"resume: the checkpoint of step {last} (trainer.mode=async) "
                                                       "had "), dropped
    train = [r for r in metric_records(out) if "train/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, last + 5))  # once each: what the killed run logged after
    resumed = {r["step"]: r for r in train if r["step"] > last}     # its checkpoint was dropped at the resume
    lags = [r["rollout/version_lag_max"] for r in resumed.values()]
    assert lags[0] == 0 and all(0 <= lag <= 2 for lag in lags), lags
