"""End to end through real Ray actors on CPU: the embedded code task, `python -m rltrain.main_grpo task=code_arithmetic`
(config/task/code_arithmetic.yaml), every response run in the sandbox by the `code` reward. A few steps of a tiny
model: every sample is scored by its own sandbox run (no reward errors, the sandbox's metrics logged). The slow test
runs the preset as it ships and checks its promise: >= 20 held-out points within 10 minutes on a 2-core CPU. Both skip,
with the probe's reason, where no sandbox backend works (the preset then exits 2: docs/data-and-rewards.md).

    pytest tests/rltrain/test_trainer_code.py -m "not slow"   # about a minute on 2 cores
"""


import pytest
import ray
from omegaconf import OmegaConf

from rltrain.job import load_job_config
from rltrain.main_grpo import run
from tests.helpers import sandbox_unavailable
from tests.rltrain.tiny_job import TINY, check_learns, compose, merge, metric_records

NO_SANDBOX = sandbox_unavailable()
pytestmark = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"needs a sandbox: {NO_SANDBOX}")
TINY_CODE = merge(TINY, {
    "trainer": {"total_steps": 2},
    "model": {"embedded": {"warmstart_steps": 20, "warmstart_eval_every": 20}},
    "data": {"task": {"max_operand": 5, "num_val": 8}},   # [2, 5]: 96 formulas, 8 held out
    "rollout": {"n": 4, "max_new_tokens": 20},            # f=lambda x:5*x**2+5 is 19 characters + <eos>
    "reward": {"num_workers": 2},
})


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()



def test_code_task_scores_every_sample_in_the_sandbox(tmp_path):
    preset = OmegaConf.to_container(compose("task=code_arithmetic"), resolve=True)
    job = load_job_config(merge(preset, merge(TINY_CODE, {"trainer": {"output_dir": str(tmp_path)}})))
    assert job.reward.name == "code" and job.data.task.kind == "code_arithmetic"
    result = run(job)
    assert result["step"] == 2
    train = [r for r in metric_records(tmp_path) if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        # no sample failed to be scored (a row without its tests, a sandbox that cannot run: reward errors), and each
        # ran its asserts in one run
        assert record["reward/errors"] == 0 and record["reward/tests_mean"] == 1.0
        assert record["reward/timed_out_mean"] == 0.0


@pytest.mark.slow
def test_code_task_preset_learns_python(tmp_path):
    """The preset as it ships: RL raises held-out accuracy (greedy programs passing their asserts in the sandbox) by
    >= 20 points within 10 minutes on a 2-core CPU. Measured (2026-11-28, seed 0, CLI): 0.010 -> 0.770 at step 10,
    0.920 at 20 (+91.0 points), 6.7 min on the 2-core machine shared with other jobs (load 7-12; the warm start 2.7
    of them)."""
    check_learns(load_job_config(compose("task=code_arithmetic", f"trainer.output_dir={tmp_path}")), "the code task")
