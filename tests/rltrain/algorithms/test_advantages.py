"""Advantage estimators against hand-computed values, per-group independence and masking; REINFORCE++ with the KL
penalty in the token rewards and a discount (algorithm.kl_in_reward, algorithm.gamma) as the trainer calls it."""

import statistics

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.advantages import ADVANTAGES, batch_advantages, compute_advantages, kl_reward
from rltrain.algorithms.config import AlgorithmConfig, DistillConfig, LossConfig


def _case():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 2.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])  # group 2 has a single response
    mask = torch.ones(7, 4)
    mask[1, 2:] = 0
    return rewards, mask, group_ids


def test_grpo_matches_hand_computation():
    rewards, mask, gid = _case()
    adv = compute_advantages("grpo", rewards, mask, gid)
    std0 = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased
    std1 = torch.tensor([3.0, 5.0]).std()
    expected = torch.tensor([0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0, -1 / std1, 1 / std1, 0.0])
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-5, atol=1e-5)
    assert torch.all(adv[1, 2:] == 0)
    torch.testing.assert_close(adv[0], adv[0, :1].expand(4))


def test_drgrpo_and_rloo():
    rewards, mask, gid = _case()
    dr = compute_advantages("drgrpo", rewards, mask, gid)[:, 0]
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, 0.0]))
    loo = compute_advantages("rloo", rewards, mask, gid)[:, 0]
    # leave-one-out: r_i - mean of the others
    expected = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 5, 5 - 3, 0.0])
    torch.testing.assert_close(loo, expected)


def test_equal_rewards_give_zero_advantage():
    rewards = torch.full((4,), 0.7)
    gid = torch.zeros(4, dtype=torch.long)
    for name in ("grpo", "drgrpo", "rloo"):
        assert torch.all(compute_advantages(name, rewards, torch.ones(4, 3), gid) == 0), name


def test_reinforce_pp_whitens_over_response_tokens():
    rewards, mask, gid = _case()
    adv = compute_advantages("reinforce_pp", rewards, mask, gid)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-5
    assert abs(valid.std().item() - 1) < 1e-4
    assert torch.all(adv[~mask.bool()] == 0)
    # outcome reward with gamma 1: every token of a response shares its advantage
    torch.testing.assert_close(adv[4], adv[4, :1].expand(4))
    assert adv[5, 0] > adv[4, 0] > adv[1, 0]


def _whiten(values: list[float]) -> list[float]:
    mean, std = statistics.mean(values), statistics.stdev(values)   # stdev: unbiased, over the response tokens
    return [(v - mean) / std for v in values]


def test_reinforce_pp_with_token_rewards_and_discount():
    """Rewards 1 and 0 on the last tokens of responses of 3 and 2 tokens, per-token terms added, γ = 0.5:
    response 0: r = (−0.1, −0.2, 1 − 0.3) -> G = (−0.1 + 0.5·0.15, −0.2 + 0.5·0.7, 0.7) = (−0.025, 0.15, 0.7);
    response 1: r = (−0.4, −0.5) -> G = (−0.4 + 0.5·(−0.5), −0.5) = (−0.65, −0.5); then whitened over the 5 tokens."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    penalties = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, -7.0]])   # -7 sits on padding: ignored
    adv = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 1]),
                             token_rewards=penalties, gamma=0.5)
    expected = _whiten([-0.025, 0.15, 0.7, -0.65, -0.5])
    torch.testing.assert_close(adv[mask.bool()], torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert adv[1, 2] == 0
    undiscounted = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 1]),
                                      token_rewards=penalties)   # γ = 1: G = (0.4, 0.5, 0.7), (−0.9, −0.5)
    torch.testing.assert_close(undiscounted[mask.bool()], torch.tensor(_whiten([0.4, 0.5, 0.7, -0.9, -0.5])),
                               rtol=1e-5, atol=1e-5)


def test_kl_in_reward_puts_minus_beta_k1_on_each_token():
    """kl_reward = −β·(old − ref) per response token; batch_advantages feeds it to reinforce_pp with the
    configured γ, and logs the mean per-response penalty."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    penalty = kl_reward(old, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(penalty, torch.tensor([[-0.05, 0.1, 0.0], [0.02, 0.05, 0.0]], dtype=torch.float64))
    batch = TensorDict({"rewards": torch.tensor([1.0, 0.0]), "response_mask": mask, "group_ids": torch.tensor([0, 1]),
                        "old_logprobs": old, "ref_logprobs": ref}, batch_size=[2])
    algorithm = AlgorithmConfig(adv_estimator="reinforce_pp", kl_in_reward=True, gamma=0.5,
                                loss=LossConfig(kl_coef=0.1))
    advantages, metrics = batch_advantages(batch, algorithm)
    torch.testing.assert_close(advantages, compute_advantages("reinforce_pp", batch["rewards"], mask,
                                                              batch["group_ids"], token_rewards=penalty, gamma=0.5))
    assert metrics["train/kl_penalty_mean"] == pytest.approx(((-0.05 + 0.1) + (0.02 + 0.05)) / 2)
    without, _ = batch_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_pp", loss=LossConfig(kl_coef=0.1)))
    assert not torch.allclose(without, advantages)
    assert algorithm.actor_loss(8).kl_coef == 0.0   # the penalty is in the reward, not in the loss


def test_distillation_adds_coef_times_teacher_minus_old_on_each_response_token():
    """algorithm.distill: each response token's advantage gains coef·(log π_teacher − log π_old), on top of the
    estimator's; masked tokens get nothing; the logged reverse KL is the mean of old − teacher over response tokens."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-0.1, -0.2, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = TensorDict({"rewards": torch.tensor([1.0, 0.0, 0.5, 0.5]), "response_mask": torch.cat([mask, mask]),
                        "group_ids": torch.tensor([0, 0, 1, 1]), "old_logprobs": torch.cat([old, old]),
                        "teacher_logprobs": torch.cat([teacher, teacher])}, batch_size=[4])
    plain, _ = batch_advantages(batch, AlgorithmConfig())
    distilled, metrics = batch_advantages(batch, AlgorithmConfig(distill=DistillConfig(teacher_path="t", coef=0.5)))
    term = torch.tensor([[0.25, -0.5, 0.0], [0.1, 0.25, 0.0]])
    torch.testing.assert_close(distilled - plain, torch.cat([term, term]))
    # the second group's rewards are equal: its advantages are the distillation term alone
    torch.testing.assert_close(distilled[2:], term)
    assert metrics["train/distill_reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0.0 - 0.2 - 0.5) / 5)
    assert "train/distill_reverse_kl" not in batch_advantages(batch, AlgorithmConfig())[1]


def test_groups_are_independent_of_order():
    rewards, mask, gid = _case()
    perm = torch.randperm(7)
    values = torch.randn(mask.shape) * mask   # gae's critic values
    for name in ADVANTAGES.names():
        options = {"values": values} if name == "gae" else {}
        full = compute_advantages(name, rewards, mask, gid, **options)
        permuted = compute_advantages(name, rewards[perm], mask[perm], gid[perm],
                                      **({"values": values[perm]} if options else {}))
        torch.testing.assert_close(permuted, full[perm], msg=name)


def test_unknown_estimator_and_bad_shapes():
    rewards, mask, gid = _case()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*drgrpo, gae, grpo, reinforce_pp, rloo"):
        compute_advantages("ppo", rewards, mask, gid)
    with pytest.raises(ValueError, match="response_mask must be"):
        compute_advantages("grpo", rewards, mask[:3], gid)
    with pytest.raises(ValueError, match="group_ids must be"):
        compute_advantages("grpo", rewards, mask, gid[:3])
