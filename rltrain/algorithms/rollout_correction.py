"""Train-vs-rollout mismatch: the rollout engine (vLLM) samples with its own kernels, so the log-probs it reports for
the sampled tokens differ slightly from the ones the actor computes for the same tokens with the same weights
(`old_logprobs`). This module measures that gap every step and, with `algorithm.rollout_correction.mode`, corrects
for it by importance sampling with the ratio π_old / π_behaviour, as in "Your efficient RL framework secretly brings
you off-policy RL training" (Yao et al., 2025; TIS) and its masked variant (MIS), verl's rollout correction:

- level `token`: one ratio per token, exp(old − behaviour); level `sequence`: one per response, the sequence's
  importance ratio, the product of its token ratios, exp(Σ_t (old − behaviour)), shared by its tokens; level
  `geometric`: their geometric mean, exp(mean_t(old − behaviour)) (a length-normalised ratio, near 1 for long
  responses, so the default bounds rarely act on it);
- mode `truncate` (TIS): each token's policy-gradient term is weighted by min(ratio, high)
  (batch["rollout_is_weights"], which the actor folds into the advantages);
- mode `mask` (MIS): tokens (or whole responses) whose ratio lies outside [low, high] leave the loss
  (batch["response_mask"] loses them, as the overlong filter does).

The behaviour policy is the rollout engine's log-probs where it reports them (`rollout_logprobs`, vLLM), else the
actor's own recomputed `old_logprobs`: then every ratio is 1 and the correction changes nothing, so one config runs
on either engine.

AReaL's decoupled objective (Fu et al., 2025; `algorithm.loss.decoupled`), for responses sampled by older weights
(trainer.mode one_step_off / async): the surrogate clips against the proximal policy π_prox, the actor's recomputed
`old_logprobs`, and weights each token by π_prox / π_behaviour, the same ratio: so it is this module's weighting with
the ratio itself as the weight, exp(old − behaviour) per token (or response, levels `sequence` / `geometric`), uncapped; with mode
`mask` the tokens outside [low, high] also leave the loss (AReaL's behaviour-weight cap), with mode `truncate` the
weight is capped at `high` (which is TIS).

    metrics = rollout_mismatch_metrics(old_logprobs, rollout_logprobs, response_mask)
    weights, mask, metrics = rollout_correction(old_logprobs, behaviour_logprobs, response_mask, config)
    metrics = apply_rollout_correction(batch, config)   # the trainer: both, into the batch
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.config import require

MODES = ("truncate", "mask")
LEVELS = ("token", "sequence", "geometric")
SEQUENCE_LOG_RATIO_BOUND = 20.0


@dataclass
class RolloutCorrectionConfig:
    mode: str | None = None     # null = off | truncate (TIS) | mask (MIS)
    level: str = "token"        # token | sequence (the product of a response's token ratios) | geometric (their mean)
    high: float = 2.0           # truncate: the cap on the weight; mask: the upper bound of the kept ratios
    low: float | None = None    # mask: the lower bound of the kept ratios; null = 1 / high

    def validate(self):
        require(self.mode is None or self.mode in MODES, "mode", f"must be null or one of {', '.join(MODES)}",
                self.mode)
        require(self.level in LEVELS, "level", f"must be one of {', '.join(LEVELS)}", self.level)
        require(self.high >= 1, "high", "must be >= 1", self.high)
        require(self.low is None or 0 < self.low <= 1, "low", "must be null or in (0, 1]", self.low)
        require(self.low is None or self.mode == "mask", "low", "applies to mode=mask only", self.low)

    @property
    def lower(self) -> float:
        return 1 / self.high if self.low is None else self.low


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


def importance_ratios(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                      level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratios, which are real) per unit of `level`: [B, R] token ratios exp(old − behaviour) and the response
    mask, or [B] sequence ratios, exp of the sum (sequence) or mean (geometric) over its tokens of old − behaviour,
    and which responses hold a token. fp64, detached; 1 where there is no token."""
    valid = response_mask != 0
    log_ratio = torch.where(valid, old_logprobs.detach().double() - behaviour_logprobs.detach().double(), 0.0)
    if level == "geometric":
        log_ratio = log_ratio.sum(1) / valid.sum(1).clamp(min=1)
    elif level == "sequence":  # a product over thousands of tokens: bounded at e^±20 (as verl) so fp32 holds it
        log_ratio = log_ratio.sum(1).clamp(-SEQUENCE_LOG_RATIO_BOUND, SEQUENCE_LOG_RATIO_BOUND)
    if level != "token":
        valid = valid.any(1)
    return torch.exp(log_ratio), valid


def _stats(values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0}
    return {"mean": float(values.mean()), "std": float(values.std(unbiased=False)), "min": float(values.min()),
            "max": float(values.max())}


def rollout_correction(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       config: RolloutCorrectionConfig, decoupled: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """(per-token weights [B, R] fp32 for truncate or decoupled, else None; the response mask with the dropped tokens
    zeroed for mask, else None; metrics). Metrics are over the units of config.level (tokens, or responses holding a
    token): the ratio's mean, std, min and max, the weight's mean (and truncate's capped share), mask's dropped
    share. decoupled: the weight is the ratio (AReaL's π_prox / π_behaviour), capped by truncate, on mask's kept
    tokens; config.mode may then be None."""
    ratio, valid = importance_ratios(old_logprobs, behaviour_logprobs, response_mask, config.level)
    metrics = {f"rollout/is_ratio_{key}": value for key, value in _stats(ratio[valid]).items()}
    per_token = (lambda x: x) if config.level == "token" else (lambda x: x[:, None].expand(response_mask.shape))
    tokens = response_mask != 0
    weights, new_mask = None, None
    if config.mode == "truncate":
        weights = ratio.clamp(max=config.high)
        metrics["rollout/is_capped_frac"] = _masked_mean((ratio > config.high).double(), valid)
    elif decoupled:
        weights = ratio
    if config.mode == "mask":
        keep = (ratio >= config.lower) & (ratio <= config.high)
        metrics["rollout/is_masked_frac"] = _masked_mean((~keep).double(), valid)
        new_mask = response_mask * per_token(keep).to(response_mask.dtype)
        valid = valid & keep
    if weights is None:
        return None, new_mask, metrics
    metrics["rollout/is_weight_mean"] = float(weights[valid].mean()) if valid.any() else 1.0
    return torch.where(tokens, per_token(weights), 1.0).float(), new_mask, metrics


def apply_rollout_correction(batch, config: RolloutCorrectionConfig, decoupled: bool = False) -> dict[str, float]:
    """The trainer's hook, after old_logprobs: the mismatch metrics where the engine reported log-probs and, with a
    mode or decoupled (algorithm.loss.decoupled), the correction against them (else against old_logprobs: ratios
    1), into batch["rollout_is_weights"] (truncate, decoupled) and batch["response_mask"] (mask)."""
    old, mask = batch["old_logprobs"], batch["response_mask"]
    reported = "rollout_logprobs" in batch.keys()
    metrics = rollout_mismatch_metrics(old, batch["rollout_logprobs"], mask) if reported else {}
    if config.mode is None and not decoupled:
        return metrics
    weights, new_mask, correction_metrics = rollout_correction(
        old, batch["rollout_logprobs"] if reported else old, mask, config, decoupled)
    if weights is not None:
        batch["rollout_is_weights"] = weights
    if new_mask is not None:
        batch["response_mask"] = new_mask
    return {**metrics, **correction_metrics}
