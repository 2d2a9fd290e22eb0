"""GAE (algorithm.adv_estimator=gae): advantages and returns against a float64 reference written from the definition,
on ragged responses with masked tokens inside (a tool's output), whitening, and batch_advantages' wiring (returns
for the critic, the in-reward KL penalty)."""

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.advantages import ADVANTAGES, batch_advantages, compute_advantages, gae_targets
from rltrain.algorithms.config import AlgorithmConfig, LossConfig


def reference_gae(rewards, values, mask, gamma, lam):
    """Per row, over its kept tokens k_0 < k_1 < ...: δ_j = r_j + γ·V_{j+1} − V_j (V after the last = 0),
    A_j = Σ_l (γλ)^l δ_{j+l}; returns A_j + V_j. Plain Python floats."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        kept = [t for t in range(rewards.shape[1]) if mask[b, t]]
        r = [float(rewards[b, t]) for t in kept]
        v = [float(values[b, t]) for t in kept] + [0.0]
        deltas = [r[j] + gamma * v[j + 1] - v[j] for j in range(len(kept))]
        for j, t in enumerate(kept):
            advantages[b, t] = sum((gamma * lam) ** l * deltas[j + l] for l in range(len(kept) - j))
    returns = torch.where(mask.bool(), advantages + values.double(), 0.0)
    return advantages, returns


def ragged_batch(generator, rows=6, width=9):
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    mask[0, :] = 0            # a response with no kept token
    mask[1, 2:4] = 0          # a tool's output inside a response: loss-masked
    mask[1, 4:] = 1
    rewards = torch.randn(rows, width, generator=generator, dtype=torch.float64) * mask
    values = torch.randn(rows, width, generator=generator, dtype=torch.float64) * mask
    return rewards, values, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_equals_the_definition(gamma, lam):
    generator = torch.Generator().manual_seed(0)
    rewards, values, mask = ragged_batch(generator)
    advantages, returns = gae_targets(rewards, values, mask, gamma, lam)
    want_advantages, want_returns = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, want_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, want_returns, rtol=1e-12, atol=1e-12)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gamma_lambda_one_is_the_return_minus_the_value():
    """γ = λ = 1 with the outcome reward on the last token: every kept token's advantage is R − V_t."""
    generator = torch.Generator().manual_seed(1)
    rewards, values, mask = ragged_batch(generator)
    outcome = torch.randn(rewards.shape[0], generator=generator, dtype=torch.float64)
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    token_rewards = torch.where(last, outcome[:, None], 0.0)
    advantages, returns = gae_targets(token_rewards, values, mask, 1.0, 1.0)
    expected = (outcome[:, None] - values) * mask
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, outcome[:, None].expand_as(mask) * mask, rtol=1e-12, atol=1e-12)


def _batch(generator, rows=8, width=6):
    mask = (torch.arange(width)[None] < torch.randint(1, width + 1, (rows,), generator=generator)[:, None]).long()
    return TensorDict({"rewards": torch.randint(0, 2, (rows,), generator=generator).float(), "response_mask": mask,
                       "group_ids": torch.arange(rows) // 2,
                       "values": torch.randn(rows, width, generator=generator) * mask,
                       "old_logprobs": -torch.rand(rows, width, generator=generator) * mask,
                       "ref_logprobs": -torch.rand(rows, width, generator=generator) * mask}, batch_size=[rows])


def test_batch_advantages_whitens_and_writes_the_returns():
    batch = _batch(torch.Generator().manual_seed(2))
    algorithm = AlgorithmConfig(adv_estimator="gae", lam=0.9)
    advantages, _ = batch_advantages(batch, algorithm)
    mask = batch["response_mask"] != 0
    assert advantages[mask].mean().abs() < 1e-6 and advantages[mask].std() == pytest.approx(1.0, rel=1e-4)
    assert (advantages[~mask] == 0).all()
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    last = mask.long().sum(1) - 1
    token_rewards[torch.arange(len(last)), last] = batch["rewards"].double()
    raw, returns = reference_gae(token_rewards, batch["values"], mask, 1.0, 0.9)
    torch.testing.assert_close(batch["returns"], returns.float())
    whitened = (raw[mask] - raw[mask].mean()) / raw[mask].std()
    torch.testing.assert_close(advantages[mask], whitened.float(), rtol=1e-4, atol=1e-5)
    # the registry's estimator gives the same advantages from the same values
    torch.testing.assert_close(compute_advantages("gae", batch["rewards"], batch["response_mask"], batch["group_ids"],
                                                  values=batch["values"], lam=0.9), advantages)


def test_the_in_reward_kl_penalty_joins_the_token_rewards():
    batch = _batch(torch.Generator().manual_seed(3))
    algorithm = AlgorithmConfig(adv_estimator="gae", kl_in_reward=True, loss=LossConfig(kl_coef=0.5))
    _, metrics = batch_advantages(batch, algorithm)
    mask = batch["response_mask"] != 0
    token_rewards = -0.5 * (batch["old_logprobs"] - batch["ref_logprobs"]).double() * mask
    last = mask.long().sum(1) - 1
    token_rewards[torch.arange(len(last)), last] += batch["rewards"].double()
    _, returns = reference_gae(token_rewards, batch["values"], mask, 1.0, 1.0)
    torch.testing.assert_close(batch["returns"], returns.float())
    assert metrics["train/kl_coef"] == 0.5 and "train/kl_penalty_mean" in metrics


def test_gae_without_values_is_refused():
    assert "gae" in ADVANTAGES
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_advantages("gae", torch.ones(2), mask, torch.arange(2))
