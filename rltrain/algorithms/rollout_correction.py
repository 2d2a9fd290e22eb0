"""Train-vs-rollout mismatch: the rollout engine (vLLM) samples with its own kernels, so the log-probs it reports for
the sampled tokens differ slightly from the ones the actor computes for the same tokens with the same weights
(`old_logprobs`). This module measures that gap every step and, optionally, corrects for it with a truncated
importance-sampling weight per token (algorithm.rollout_is_cap), as in "Your efficient RL framework secretly brings
you off-policy RL training" (Yao et al., 2025) and verl's rollout correction.

    metrics = rollout_mismatch_metrics(old_logprobs, rollout_logprobs, response_mask)
    weights, is_metrics = truncated_is_weights(old_logprobs, rollout_logprobs, response_mask, cap=2.0)  # [B, R]
    metrics = apply_rollout_correction(batch, cap)   # the trainer: both, weights into batch["rollout_is_weights"]
"""

from __future__ import annotations

import torch


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def rollout_mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """Mean over response tokens of |old − rollout| and the k3 estimate of KL(π_rollout ‖ π_old) from the tokens
    the rollout sampled: with log r = old − rollout, E_rollout[r − log r − 1] = KL, and each term is >= 0."""
    log_ratio = old_logprobs.double() - rollout_logprobs.double()  # fp64: the gaps are near fp32's rounding
    k3 = torch.expm1(log_ratio) - log_ratio
    return {"rollout/logprob_abs_diff_mean": _masked_mean(log_ratio.abs(), response_mask),
            "rollout/logprob_abs_diff_max": float((log_ratio.abs() * response_mask).max()),
            "rollout/kl": _masked_mean(k3, response_mask)}


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights min(exp(old − rollout), cap) (1 where masked), detached, and their metrics.

    The policy-gradient term of each token is multiplied by its weight: the samples came from π_rollout, the
    surrogate assumes π_old, and the truncation bounds the variance (TIS)."""
    ratio = torch.exp(old_logprobs.detach().float() - rollout_logprobs.detach().float())
    weights = torch.where(response_mask != 0, ratio.clamp(max=cap), torch.ones_like(ratio))
    metrics = {"rollout/is_weight_mean": _masked_mean(weights, response_mask),
               "rollout/is_capped_frac": _masked_mean((ratio > cap).float(), response_mask)}
    return weights, metrics


def apply_rollout_correction(batch, cap: float | None) -> dict[str, float]:
    """The trainer's hook, after old_logprobs: mismatch metrics when the engine reported log-probs, and with a cap
    the weights as batch["rollout_is_weights"] (the actor scales each token's policy-gradient term by them)."""
    if "rollout_logprobs" not in batch.keys():
        return {}
    old, rollout, mask = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    metrics = rollout_mismatch_metrics(old, rollout, mask)
    if cap is not None:
        batch["rollout_is_weights"], is_metrics = truncated_is_weights(old, rollout, mask, cap)
        metrics.update(is_metrics)
    return metrics
