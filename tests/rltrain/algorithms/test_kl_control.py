"""algorithm.kl_ctrl: the in-reward KL penalty's β, fixed or adaptive (rltrain/algorithms/kl_control.py):

- the batch KL is the mean over responses of each response's mean per-token k1 (a float64 reference on a ragged
  mask, an empty response counted as 0);
- adaptive β follows β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), fixed β never moves; its state round-trips;
- batch_advantages takes this step's β for the penalty and reports it with the KL;
- adaptive without kl_in_reward, an unknown type, target_kl ≤ 0 or horizon < 1: errors naming the key;
- end to end: REINFORCE++ with an adaptive β for 3 steps logs each step's β as the previous step's, moved by the
  formula from the KL it logged, and the checkpoint holds the next step's β.
"""

import json

import pytest
import ray
import torch
from tensordict import TensorDict

from rltrain.algorithms.advantages import batch_advantages
from rltrain.algorithms.config import AlgorithmConfig
from rltrain.algorithms.kl_control import KLControlConfig, KLController, batch_kl
from rltrain.config import ConfigError, from_mapping
from rltrain.main_grpo import run
from tests.rltrain.tiny_job import tiny_job


def _ragged(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    old, ref = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    return old, ref, mask


def test_batch_kl_is_the_mean_of_per_response_token_means():
    old, ref, mask = _ragged()
    expected = []
    for row in range(4):
        tokens = [float(old[row, t]) - float(ref[row, t]) for t in range(4) if mask[row, t]]
        expected.append(sum(tokens) / len(tokens) if tokens else 0.0)
    assert batch_kl(old, ref, mask) == pytest.approx(sum(expected) / 4, abs=1e-12)


def test_adaptive_beta_follows_the_formula_and_fixed_stays():
    adaptive = KLController(KLControlConfig(type="adaptive", target_kl=0.1, horizon=100), coef=0.01)
    adaptive.update(0.5, responses=10)    # far above target: error clipped at +0.2
    assert adaptive.coef == pytest.approx(0.01 * (1 + 0.2 * 10 / 100))
    adaptive.update(0.11, responses=10)   # 10% above: error 0.1
    assert adaptive.coef == pytest.approx(0.01 * 1.02 * (1 + 0.1 * 0.1))
    adaptive.update(0.0, responses=50)    # far below: error clipped at −0.2
    assert adaptive.coef == pytest.approx(0.01 * 1.02 * 1.01 * (1 - 0.2 * 0.5))
    restored = KLController(KLControlConfig(type="adaptive"), coef=1.0)
    restored.load_state_dict(json.loads(json.dumps(adaptive.state_dict())))
    assert restored.coef == adaptive.coef
    fixed = KLController(KLControlConfig(), coef=0.01)
    fixed.update(0.5, responses=10)
    assert fixed.coef == 0.01


def test_batch_advantages_take_this_steps_beta():
    old, ref, mask = _ragged(1)
    batch = TensorDict({"old_logprobs": old, "ref_logprobs": ref, "response_mask": mask,
                        "rewards": torch.tensor([1.0, 0.0, 0.5, 1.0]), "group_ids": torch.tensor([0, 0, 1, 1])},
                       batch_size=[4])
    algorithm = from_mapping(AlgorithmConfig, {"adv_estimator": "reinforce_pp", "kl_in_reward": True,
                                               "loss": {"kl_coef": 0.01}}, "algorithm")
    _, at_config = batch_advantages(batch, algorithm)
    _, at_beta = batch_advantages(batch, algorithm, kl_coef=0.03)
    assert at_config["train/kl_coef"] == 0.01 and at_beta["train/kl_coef"] == 0.03
    assert at_beta["train/kl_penalty_mean"] == pytest.approx(3 * at_config["train/kl_penalty_mean"])
    assert at_beta["train/kl"] == at_config["train/kl"] == pytest.approx(batch_kl(old, ref, mask))


@pytest.mark.parametrize("settings, message", [
    ({"kl_ctrl": {"type": "adaptive"}}, r"^algorithm.kl_ctrl.type: adaptive steers the in-reward KL penalty"),
    ({"kl_ctrl": {"type": "pid"}}, r"^algorithm.kl_ctrl.type: must be one of fixed, adaptive"),
    ({"kl_ctrl": {"target_kl": 0.0}}, r"^algorithm.kl_ctrl.target_kl: must be > 0"),
    ({"kl_ctrl": {"horizon": 0}}, r"^algorithm.kl_ctrl.horizon: must be >= 1"),
])
def test_bad_settings_name_their_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_mapping(AlgorithmConfig, settings, "algorithm")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_adaptive_beta_moves_step_by_step_and_is_checkpointed(tmp_path, ray_session):
    target, horizon = 1e-6, 40   # a target the policy passes at once: β grows by 1 + 0.2·16/40 a step
    job = tiny_job(tmp_path, trainer={"total_steps": 3},
                   actor={"lr": 0.05},
                   algorithm={"adv_estimator": "reinforce_pp", "kl_in_reward": True, "loss": {"kl_coef": 0.01},
                              "kl_ctrl": {"type": "adaptive", "target_kl": target, "horizon": horizon}})
    assert run(job)["step"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/kl_coef" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and train[0]["train/kl_coef"] == 0.01
    beta = 0.01
    for before, after in zip(train, train[1:] + [None]):
        error = min(max(before["train/kl"] / target - 1, -0.2), 0.2)
        beta *= 1 + error * 16 / horizon    # 4 prompts × n 4 responses a step
        if after is not None:
            assert after["train/kl_coef"] == pytest.approx(beta, rel=1e-9), (before, after)
    assert train[2]["train/kl_coef"] != train[0]["train/kl_coef"]
    state = json.loads((tmp_path / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["kl_control"]["coef"] == pytest.approx(beta, rel=1e-9)
