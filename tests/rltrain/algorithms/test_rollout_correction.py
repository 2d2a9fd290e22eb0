"""Train-vs-rollout mismatch metrics and the truncated importance-sampling correction (algorithm.rollout_is_cap):
the metrics against their definitions, the weights' cap, and the actor's way of applying them — scaling the
advantages per token — against a literal per-token weighting of the policy-gradient term, loss and gradients."""

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.rollout_correction import (
    apply_rollout_correction, rollout_mismatch_metrics, truncated_is_weights,
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


def test_truncated_weights_are_capped_ratios_and_one_where_masked():
    old, rollout, mask = _logprobs()
    weights, metrics = truncated_is_weights(old, rollout, mask, cap=1.1)
    ratio = torch.exp(old - rollout)
    valid = mask.bool()
    assert torch.allclose(weights[valid], ratio[valid].clamp(max=1.1))
    assert (weights[~valid] == 1).all() and not weights.requires_grad
    assert metrics["rollout/is_capped_frac"] == pytest.approx((ratio[valid] > 1.1).float().mean().item())
    assert 0 < metrics["rollout/is_capped_frac"] < 1


def test_apply_is_a_no_op_without_rollout_logprobs_and_sets_weights_with_a_cap():
    old, rollout, mask = _logprobs()
    batch = TensorDict({"old_logprobs": old, "response_mask": mask}, batch_size=[3])
    assert apply_rollout_correction(batch, 2.0) == {} and "rollout_is_weights" not in batch.keys()
    batch["rollout_logprobs"] = rollout
    assert set(apply_rollout_correction(batch, None)) == {"rollout/logprob_abs_diff_mean",
                                                          "rollout/logprob_abs_diff_max", "rollout/kl"}
    assert "rollout_is_weights" not in batch.keys()
    assert "rollout/is_weight_mean" in apply_rollout_correction(batch, 2.0)
    assert torch.equal(batch["rollout_is_weights"], truncated_is_weights(old, rollout, mask, 2.0)[0])


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
