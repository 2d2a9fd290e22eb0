"""End to end through real Ray actors on CPU: the embedded chain task's preset (`python -m rltrain.main_grpo
task=chain_arithmetic`, config/task/chain_arithmetic.yaml), made tiny and run on the transformers engine: the rows
reach the `math` reward through `default` with no errors, the warm start's tokenizer holds the answer line's `#`, and
two steps train. Its GPU-sized run, held-out +32.5 points by step 80 on one H200, is in README.md (On one GPU).

    pytest tests/rltrain/test_trainer_chain.py   # about 25 s on 2 cores
"""

import pytest
import ray
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rltrain.job import load_job_config
from rltrain.main_grpo import run
from tests.rltrain.tiny_job import TINY, compose, merge, metric_records


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_chain_preset_trains_on_the_cpu_with_the_transformers_engine(tmp_path):
    preset = OmegaConf.to_container(compose("task=chain_arithmetic"), resolve=True)
    tiny = merge(TINY, {"trainer": {"output_dir": str(tmp_path), "device": "cpu", "val_every": 2},
                        "model": {"embedded": {"warmstart_steps": 20, "warmstart_eval_every": 20}},
                        "data": {"task": {"max_operand": 30, "max_terms": 4, "num_val": 8}},
                        "rollout": {"engine": "hf", "max_new_tokens": 48}})
    job = load_job_config(merge(preset, tiny))
    assert job.data.task.kind == "chain_arithmetic" and job.model.embedded.hidden_size == 32
    assert run(job)["step"] == 2
    records = metric_records(tmp_path)
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["reward/errors"] == 0 and 0.0 <= record["train/reward_mean"] <= 1.0
        assert 0 < record["train/response_len_mean"] <= 48
    assert [r["step"] for r in records if "val/reward_mean" in r] == [0, 2]
    (warm,) = (tmp_path / "warmstart").iterdir()
    assert "#" in AutoTokenizer.from_pretrained(warm).get_vocab()
