"""End to end through real Ray actors on CPU: the embedded default runs and writes its metrics and checkpoints;
reward plugins that raise or hang are scored 0 and counted; a killed run resumes at the right step and sees exactly
the data an uninterrupted run sees."""

import json
import math
import shutil
import textwrap

import pytest
import ray
from omegaconf import OmegaConf

from rltrain.checkpoint import latest_checkpoint
from rltrain.main_grpo import run
from tests.rltrain.tiny_job import compose, tiny_job

REQUIRED = {"step", "train/reward_mean", "train/response_len_mean", "actor/loss", "actor/entropy", "actor/ppo_kl",
            "actor/clipfrac", "actor/grad_norm", "reward/errors", "time/step_s", "perf/tokens_per_s"}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _records(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_embedded_default_runs_with_kl_and_plugin_errors(tmp_path):
    plugin = tmp_path / "reward.py"
    plugin.write_text(textwrap.dedent("""
        import time

        def score(data_source, solution_str, ground_truth, extra_info=None):
            if int(ground_truth) % 3 == 0:
                raise ValueError("multiples of three are cursed")
            if int(ground_truth) % 3 == 1:
                time.sleep(30)
            return {"score": 1.0, "bonus": 0.5}
    """))
    out = tmp_path / "run"
    job = tiny_job(out, trainer={"save_every": 1, "val_every": 1, "logger": ["jsonl", "console"]},
                   reward={"path": str(plugin), "name": "score", "timeout_s": 0.5},
                   algorithm={"loss": {"kl_coef": 0.05}})
    result = run(job)
    assert result["step"] == 2
    records = _records(out)
    train = [r for r in records if "train/reward_mean" in r]
    val = [r for r in records if "val/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in val] == [0, 1, 2]
    for record in train:
        assert REQUIRED <= set(record), REQUIRED - set(record)
        responses = 4 * 4
        # every response either scored 1.0 (ground truth 2 mod 3) or failed (raised / timed out) and scored 0
        assert record["reward/errors"] + record["train/reward_mean"] * responses == pytest.approx(responses)
        assert 0 < record["reward/errors"] < responses
        assert record["reward/bonus_mean"] == 0.5
        assert "actor/ref_kl" in record
    assert latest_checkpoint(str(out)).name == "step_000002"
    assert (out / "checkpoints" / "step_000001" / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("preset", ["drgrpo", "dapo", "gspo", "rloo", "reinforce_pp"])
def test_algorithm_presets_train(tmp_path, preset):
    """Each preset of config/algorithm/ through the real trainer: 2 steps, finite loss and gradient norm."""
    algorithm = OmegaConf.to_container(compose(f"algorithm={preset}").algorithm, resolve=True)
    # a reward that is 0 or 1 about evenly over random responses, so groups differ (DAPO drops all-equal ones)
    plugin = tmp_path / "reward.py"
    plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    out = tmp_path / "run"
    result = run(tiny_job(out, algorithm=algorithm, reward={"path": str(plugin), "name": "score"},
                          rollout={"temperature": 1.5}))
    assert result["step"] == 2
    train = [r for r in _records(out) if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert math.isfinite(record["actor/loss"]) and math.isfinite(record["actor/grad_norm"]), record
    if preset == "dapo":
        assert all(r["train/groups_kept"] > 0 for r in train), train


def test_resume_continues_at_the_right_step_with_identical_data(tmp_path):
    straight = tmp_path / "straight"
    run(tiny_job(straight, trainer={"total_steps": 3}))
    killed = tmp_path / "killed"
    run(tiny_job(killed, trainer={"total_steps": 2, "save_every": 1}))
    shutil.rmtree(killed / "checkpoints" / "step_000002")  # as if killed between the step-1 and step-2 saves
    (killed / "checkpoints" / ".tmp_step_000002").mkdir()  # a half-written save is ignored
    result = run(tiny_job(killed, trainer={"total_steps": 3}))
    assert result["step"] == 3
    resumed = [r for r in _records(killed) if "train/reward_mean" in r]
    assert [r["step"] for r in resumed] == [1, 2, 2, 3]  # step 2 ran again after the resume from step 1
    reference = {r["step"]: r for r in _records(straight) if "train/reward_mean" in r}
    for record in resumed[2:]:
        for key in ("train/reward_mean", "train/response_len_mean", "actor/loss", "actor/grad_norm"):
            assert record[key] == pytest.approx(reference[record["step"]][key], rel=1e-6, abs=1e-7), key


def test_embedded_default_learns(tmp_path):
    """RL raises held-out accuracy: the embedded task with the default model and algorithm, 100 steps (about a
    minute on 2 cores). Seed 1 measured +21 points at this length; the bar is +8."""
    job = tiny_job(tmp_path, trainer={"total_steps": 100, "val_every": 50, "seed": 1},
                   model={"embedded": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "head_dim": 32,
                                       "warmstart_steps": 600, "warmstart_batch_size": 64}},
                   data={"batch_size": 16, "task": {"max_operand": 49, "num_val": 200}},
                   rollout={"n": 16, "max_new_tokens": 8, "torch_threads": 0},
                   actor={"micro_batch_size": 64, "torch_threads": 0}, reward={"num_workers": 2})
    result = run(job)
    val = [r["val/reward_mean"] for r in _records(tmp_path) if "val/reward_mean" in r]
    assert len(val) == 3
    assert result["final_val"] >= result["initial_val"] + 0.08, val
