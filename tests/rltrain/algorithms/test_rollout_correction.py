"""Train-vs-rollout mismatch metrics and the importance correction (algorithm.rollout_correction): the metrics
against their definitions; truncation (TIS) and masking (MIS) at token and sequence level against hand-computed
ratios; the actor's recomputed log-probs as the behaviour policy when the engine reports none; and the actor's way of
applying the weights — scaling the advantages per token — against a literal per-token weighting of the
policy-gradient term, loss and gradients."""

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.rollout_correction import (
    RolloutCorrectionConfig, apply_rollout_correction, rollout_correction, rollout_mismatch_metrics,
)
from rltrain.workers.actor import weighted_advantages


def _logprobs(B=3, R=5):
    old = -torch.rand(B, R) * 3
    rollout = old + 0.3 * torch.randn(B, R)
    mask = torch.ones(B, R, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return old, rollout, mask


def test_mismatch_metrics_follow_their_definitions():
    old, rollout, mask = _logprobs()
    metrics = rollout_mismatch_metrics(old, rollout, mask)
    valid = mask.bool()
    diff = (old - rollout).double()[valid]
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(diff.abs().mean().item(), rel=1e-9)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(diff.abs().max().item(), rel=1e-9)
    assert metrics["rollout/kl"] == pytest.approx((diff.exp() - diff - 1).mean().item(), rel=1e-9)
    assert metrics["rollout/kl"] > 0
    same = rollout_mismatch_metrics(old, old.clone(), mask)
    assert same["rollout/logprob_abs_diff_mean"] == 0 and same["rollout/kl"] == 0


def _hand_case():
    """Behaviour log-probs 0, so each token's ratio is exp(old); response 0: ratios 2, 1/2 (geometric mean 1),
    response 1: 4, 4, 4 (mean 4), response 2: 1/4 then two padding tokens, response 3: no token at all."""
    ratios = torch.tensor([[2.0, 0.5, 1.0], [4.0, 4.0, 4.0], [0.25, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    return ratios.log(), torch.zeros(4, 3, dtype=torch.float64), mask   # fp64: the bounds are hit exactly


def test_token_truncation_caps_each_ratio():
    old, behaviour, mask = _hand_case()
    weights, new_mask, metrics = rollout_correction(old, behaviour, mask, RolloutCorrectionConfig("truncate", high=2.0))
    assert new_mask is None and weights.dtype == torch.float32 and not weights.requires_grad
    expected = torch.tensor([[2.0, 0.5, 1.0], [2.0, 2.0, 2.0], [0.25, 1.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    units = torch.tensor([2.0, 0.5, 4.0, 4.0, 4.0, 0.25], dtype=torch.float64)   # the 6 response tokens
    assert metrics["rollout/is_ratio_mean"] == pytest.approx(units.mean().item())
    assert metrics["rollout/is_ratio_std"] == pytest.approx(units.std(unbiased=False).item())
    assert (metrics["rollout/is_ratio_min"], metrics["rollout/is_ratio_max"]) == pytest.approx((0.25, 4.0))
    assert metrics["rollout/is_capped_frac"] == pytest.approx(3 / 6)
    assert metrics["rollout/is_weight_mean"] == pytest.approx((2 + 0.5 + 6 + 0.25) / 6)


def test_sequence_truncation_weights_each_response_by_its_importance_ratio():
    old, behaviour, mask = _hand_case()
    config = RolloutCorrectionConfig("truncate", level="sequence", high=2.0)
    weights, _, metrics = rollout_correction(old, behaviour, mask, config)
    # the product of each response's token ratios: response 0: 2 · 1/2 = 1; response 1: 4³ = 64, capped at 2;
    # response 2: 1/4; response 3: no token
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.25, 1.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout/is_ratio_mean"] == pytest.approx((1 + 64 + 0.25) / 3)
    assert (metrics["rollout/is_ratio_min"], metrics["rollout/is_ratio_max"]) == pytest.approx((0.25, 64.0))
    assert metrics["rollout/is_capped_frac"] == pytest.approx(1 / 3)


def test_geometric_truncation_weights_each_response_by_its_geometric_mean_ratio():
    old, behaviour, mask = _hand_case()
    config = RolloutCorrectionConfig("truncate", level="geometric", high=2.0)
    weights, _, metrics = rollout_correction(old, behaviour, mask, config)
    # response 0: (2 · 1/2)^(1/2) = 1; response 1: 4, capped at 2; response 2: 1/4; response 3: no token
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.25, 1.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout/is_ratio_mean"] == pytest.approx((1 + 4 + 0.25) / 3)
    assert (metrics["rollout/is_ratio_min"], metrics["rollout/is_ratio_max"]) == pytest.approx((0.25, 4.0))


def test_sequence_ratio_is_bounded_for_long_responses():
    """A product over many tokens would overflow fp32: its log is held in [-20, 20]."""
    old, behaviour = torch.full((2, 4000), 0.05, dtype=torch.float64), torch.zeros(2, 4000, dtype=torch.float64)
    old[1] = -0.05
    mask = torch.ones(2, 4000, dtype=torch.long)
    weights, _, _ = rollout_correction(old, behaviour, mask, RolloutCorrectionConfig(level="sequence"), decoupled=True)
    torch.testing.assert_close(weights[:, 0], torch.tensor([20.0, -20.0]).exp().float())


@pytest.mark.parametrize("level, low, kept, dropped", [
    ("token", None, [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], 4 / 6),    # [1/2, 2]: 2 and 1/2 stay
    ("token", 0.2, [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]], 3 / 6),     # [0.2, 2]: 1/4 stays too
    ("sequence", None, [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], 2 / 3),  # responses 1 (4) and 2 (1/4) go
    ("sequence", 0.25, [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]], 1 / 3),  # the bound itself is kept
], ids=["token-default-low", "token-low-0.2", "sequence-default-low", "sequence-low-0.25"])
def test_masking_drops_tokens_or_responses_outside_the_bounds(level, low, kept, dropped):
    old, behaviour, mask = _hand_case()
    config = RolloutCorrectionConfig("mask", level=level, high=2.0, low=low)
    weights, new_mask, metrics = rollout_correction(old, behaviour, mask, config)
    assert weights is None and new_mask.dtype == mask.dtype
    assert new_mask.tolist() == kept
    assert metrics["rollout/is_masked_frac"] == pytest.approx(dropped)


def test_apply_uses_the_actors_log_probs_when_the_engine_reports_none():
    """hf engine: no rollout_logprobs, so the behaviour policy is old_logprobs: ratios 1, nothing capped or dropped,
    no mismatch metrics; with the engine's log-probs the weights and mismatch metrics are the functions' own. Two
    tokens are pinned, one at ratio 1 and one at e, so the [1/1.1, 1.1] bounds below cap or drop some tokens but not
    all whatever the draw (9 drawn ratios all fell outside them about 1 draw in 13)."""
    old, rollout, mask = _logprobs()
    rollout[1, 0], rollout[1, 1] = old[1, 0], old[1, 1] - 1.0
    for mode in ("truncate", "mask"):
        batch = TensorDict({"old_logprobs": old, "response_mask": mask}, batch_size=[3])
        metrics = apply_rollout_correction(batch, RolloutCorrectionConfig(mode, level="sequence", high=1.01))
        assert not any(key.startswith("rollout/logprob") for key in metrics)
        assert metrics["rollout/is_ratio_min"] == metrics["rollout/is_ratio_max"] == 1.0
        assert metrics.get("rollout/is_masked_frac", 0) == metrics.get("rollout/is_capped_frac", 0) == 0
        assert torch.equal(batch["response_mask"], mask)
        assert mode == "mask" or torch.equal(batch["rollout_is_weights"], torch.ones(3, 5))
    batch = TensorDict({"old_logprobs": old, "response_mask": mask}, batch_size=[3])
    assert apply_rollout_correction(batch, RolloutCorrectionConfig()) == {} and "rollout_is_weights" not in batch.keys()
    batch["rollout_logprobs"] = rollout
    assert set(apply_rollout_correction(batch, RolloutCorrectionConfig())) == {
        "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl"}
    assert "rollout_is_weights" not in batch.keys()
    config = RolloutCorrectionConfig("truncate", high=1.1)
    metrics = apply_rollout_correction(batch, config)
    assert "rollout/kl" in metrics and 0 < metrics["rollout/is_capped_frac"] < 1
    assert torch.equal(batch["rollout_is_weights"], rollout_correction(old, rollout, mask, config)[0])
    metrics = apply_rollout_correction(batch, RolloutCorrectionConfig("mask", high=1.1))
    assert 0 < metrics["rollout/is_masked_frac"] < 1 and batch["response_mask"].sum() < mask.sum()


@pytest.mark.parametrize("dual_clip", [None, 3.0], ids=["no-dual-clip", "dual-clip-3"])
@pytest.mark.parametrize("advantage_shape", ["per-sequence", "per-token"])
def test_weighted_advantages_equal_a_weighted_policy_gradient_term(dual_clip, advantage_shape):
    from rltrain_kernels import fused_policy_loss

    B, R, H, V = 4, 6, 8, 11
    hidden = torch.randn(B, R, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, R))
    mask = (torch.rand(B, R) > 0.2).long()
    mask[:, 0] = 1
    advantages = torch.randn(B, dtype=torch.float64) if advantage_shape == "per-sequence" else \
        torch.randn(B, R, dtype=torch.float64)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]
    old = logp + 0.3 * torch.randn(B, R, dtype=torch.float64)  # ratios far enough from 1 to clip
    weights = 0.2 + 1.6 * torch.rand(B, R, dtype=torch.float64)
    batch = TensorDict({"advantages": advantages, "rollout_is_weights": weights}, batch_size=[B])
    out = fused_policy_loss(hidden, weight, labels, mask, weighted_advantages(batch), old, dual_clip=dual_clip,
                            clip_low=0.2, clip_high=0.28)
    out.loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    # the definition: each token's policy-gradient term times its weight, token-mean
    adv = advantages[:, None].expand(B, R) if advantages.dim() == 1 else advantages
    ratio = torch.exp(torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0] - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    expected = (weights * pg * mask).sum() / mask.sum()
    expected.backward()
    assert torch.allclose(out.loss, expected, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grads[0], hidden.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(grads[1], weight.grad, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(out.loss, (pg * mask).sum() / mask.sum())  # the weights do matter


def test_without_weights_the_advantages_pass_through():
    advantages = torch.randn(3, 4)
    assert weighted_advantages(TensorDict({"advantages": advantages}, batch_size=[3])) is advantages
