"""Advantage estimators against hand-computed values, per-group independence and masking."""

import pytest
import torch

from rltrain.algorithms.advantages import ADVANTAGES, compute_advantages


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


def test_groups_are_independent_of_order():
    rewards, mask, gid = _case()
    perm = torch.randperm(7)
    for name in ADVANTAGES.names():
        full = compute_advantages(name, rewards, mask, gid)
        permuted = compute_advantages(name, rewards[perm], mask[perm], gid[perm])
        torch.testing.assert_close(permuted, full[perm], msg=name)


def test_unknown_estimator_and_bad_shapes():
    rewards, mask, gid = _case()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*drgrpo, grpo, reinforce_pp, rloo"):
        compute_advantages("ppo", rewards, mask, gid)
    with pytest.raises(ValueError, match="response_mask must be"):
        compute_advantages("grpo", rewards, mask[:3], gid)
    with pytest.raises(ValueError, match="group_ids must be"):
        compute_advantages("grpo", rewards, mask, gid[:3])
