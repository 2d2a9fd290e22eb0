"""PPO through the real trainer (algorithm=ppo: a critic role, GAE): the critic's warm-up step trains it alone, its
metrics and phases are logged, checkpoints hold it, a resumed run replays an uninterrupted one's steps, and a
checkpoint with a critic refuses a resume without one; a LoRA critic (critic.lora) trains through the trainer."""

import json

import pytest
import ray
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader

from rltrain.config import ConfigError
from rltrain.main_grpo import run
from tests.rltrain.tiny_job import compose, tiny_job

CRITIC_METRICS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                  "critic/values_mean", "critic/returns_mean", "critic/vf_explained_var", "time/values_s",
                  "time/critic_s"}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _train_records(output_dir) -> dict[int, dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "train/reward_mean" in r}


def _job(output_dir, tmp_path, preset="ppo", critic=None, **trainer):
    plugin = tmp_path / "reward.py"   # 0 or 1 about evenly: returns and advantages that are not all alike
    plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    algorithm = OmegaConf.to_container(compose(f"algorithm={preset}").algorithm, resolve=True)
    return tiny_job(output_dir, algorithm=algorithm, critic={"warmup_steps": 1, "lr": 0.01, **(critic or {})},
                    reward={"path": str(plugin), "name": "score"}, rollout={"temperature": 1.5},
                    trainer={"total_steps": 3, "save_every": 1, **trainer})


def test_ppo_warms_the_critic_up_checkpoints_it_and_resumes_exactly(tmp_path):
    reference = tmp_path / "reference"
    assert run(_job(reference, tmp_path))["step"] == 3
    steps = _train_records(reference)
    assert CRITIC_METRICS <= set(steps[1]) and "actor/loss" not in steps[1]   # the warm-up: the critic alone
    for step in (2, 3):
        assert CRITIC_METRICS | {"actor/loss", "actor/grad_norm"} <= set(steps[step]), steps[step]
    assert steps[3]["critic/vf_loss"] != steps[2]["critic/vf_loss"]
    for step in (1, 2, 3):
        assert (reference / "checkpoints" / f"step_{step:06d}" / "critic" / "model" / ".metadata").is_file()

    resumed = tmp_path / "resumed"
    run(_job(resumed, tmp_path, total_steps=2))
    run(_job(resumed, tmp_path))   # resume=auto from step 2: the critic's weights, optimizer state and schedule
    replayed = _train_records(resumed)[3]
    for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/loss", "actor/grad_norm"):
        assert replayed[key] == pytest.approx(steps[3][key], rel=1e-5, abs=1e-7), key

    with pytest.raises(ConfigError, match="holds a critic, but algorithm.adv_estimator is grpo"):
        run(_job(resumed, tmp_path, preset="grpo", total_steps=4))


def test_ppo_with_a_lora_critic(tmp_path):
    out = tmp_path / "lora"
    assert run(_job(out, tmp_path, critic={"lora": {"rank": 4, "alpha": 8.0}}, total_steps=2, save_every=2))["step"] == 2
    steps = _train_records(out)
    assert all(steps[step]["critic/grad_norm"] > 0 for step in (1, 2))
    assert steps[2]["critic/values_mean"] != 0   # the warm-up step moved the value head and adapters
    reader = FileSystemReader(str(out / "checkpoints" / "step_000002" / "critic" / "model"))
    saved = set(reader.read_metadata().state_dict_metadata)   # the adapters and the value head, no frozen weight
    assert {"value_head.weight", "value_head.bias"} <= saved and any("lora_A" in name for name in saved)
    assert all("lora_" in name or name.startswith("value_head.") for name in saved), sorted(saved)[:5]
