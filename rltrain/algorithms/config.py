"""The `algorithm` config section: advantage estimator, policy-loss options (passed to
rltrain_kernels.fused_policy_loss) and the DAPO switches."""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.algorithms.advantages import ADVANTAGES
from rltrain.config import require

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2          # DAPO's clip-higher: e.g. 0.28
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens at -A*c
    kl_coef: float = 0.0            # > 0 starts the reference worker
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    importance_level: str = "token"  # "sequence" = GSPO

    def validate(self):
        require(0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)", self.clip_low)
        require(self.clip_high >= 0, "clip_high", "must be >= 0", self.clip_high)
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be null or > 1", self.dual_clip)
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0", self.kl_coef)
        require(self.kl_type in ("k1", "k2", "k3"), "kl_type", "must be one of k1, k2, k3", self.kl_type)
        require(self.loss_agg in LOSS_AGGS, "loss_agg", f"must be one of {', '.join(LOSS_AGGS)}", self.loss_agg)
        require(self.importance_level in ("token", "sequence"), "importance_level", "must be token or sequence",
                self.importance_level)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"           # grpo | drgrpo | rloo | reinforce_pp
    loss: LossConfig = field(default_factory=LossConfig)
    dynamic_sampling: bool = False        # DAPO: drop groups whose rewards are all equal, refill the batch
    dynamic_sampling_max_rounds: int = 4  # extra generation rounds allowed to refill one batch
    overlong_filter: bool = False         # DAPO: mask out truncated responses (no <eos> within max_new_tokens)
    rollout_is_cap: float | None = None   # truncated IS: weight each token's pg term by min(π_old/π_rollout, cap)

    def validate(self):
        require(self.adv_estimator in ADVANTAGES, "adv_estimator",
                f"unknown advantage estimator; known: {', '.join(ADVANTAGES.names())}", self.adv_estimator)
        require(self.dynamic_sampling_max_rounds >= 0, "dynamic_sampling_max_rounds", "must be >= 0",
                self.dynamic_sampling_max_rounds)
        require(self.rollout_is_cap is None or self.rollout_is_cap >= 1, "rollout_is_cap", "must be null or >= 1",
                self.rollout_is_cap)
