"""The `algorithm` config section: advantage estimator, policy-loss options (passed to
rltrain_kernels.fused_policy_loss), the DAPO switches, the rollout importance correction and on-policy distillation.

`algorithm.loss` (LossConfig) is the kernel's PolicyLossOptions itself, its fields, defaults and checks, less the
per-call temperature and normaliser (the actor's: `kernel_options()` leaves them out), plus `decoupled` (AReaL's
objective), which is the trainer's, a per-token weight on the policy-gradient term
(rltrain/algorithms/rollout_correction.py), not a kernel option. The kernel's checks run on construction and name
the option they reject (PolicyLossOptionError), reported as algorithm.loss.<option>."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from rltrain_kernels.ops.policy_loss.options import PolicyLossOptionError, PolicyLossOptions

from rltrain.algorithms.advantages import ADVANTAGES
from rltrain.algorithms.kl_control import KLControlConfig
from rltrain.algorithms.rollout_correction import RolloutCorrectionConfig
from rltrain.config import require


OLD_LOGPROBS = ("auto", "actor", "rollout", "update")


@dataclass(frozen=True)
class LossConfig(PolicyLossOptions):
    """The kernel's options as config keys (config/algorithm/*.yaml comments them), plus decoupled. norm_len: None =
    rollout.max_new_tokens (AlgorithmConfig.actor_loss)."""
    # per call, not config keys (the actor passes the sampling temperature and each mini-batch's token count)
    temperature: float = field(default=PolicyLossOptions.temperature, init=False)
    norm_tokens: float | None = field(default=PolicyLossOptions.norm_tokens, init=False)
    decoupled: bool = False          # AReaL: clip against π_prox (old_logprobs), pg term × π_prox / π_behaviour

    def __post_init__(self):
        try:
            super().__post_init__()
        except PolicyLossOptionError as err:  # the kernel names the option it rejects: this section's key
            require(False, err.option, err.reason)

    def kernel_options(self) -> dict:
        """The options fused_policy_loss takes from the config (all but decoupled and the per-call ones)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "decoupled"}

    def validate(self):
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0 (> 0 adds the KL penalty)", self.kl_coef)


@dataclass
class OverlongBufferConfig:
    len: int = 0                  # DAPO's L_cache: the last N tokens before rollout.max_new_tokens; 0 = off
    penalty_factor: float = 1.0   # the penalty at rollout.max_new_tokens

    def validate(self):
        require(self.len >= 0, "len", "must be >= 0 (0 = off)", self.len)
        require(self.penalty_factor >= 0, "penalty_factor", "must be >= 0", self.penalty_factor)


DISTILL_KL = ("sampled", "exact")


@dataclass
class DistillConfig:
    """On-policy distillation's reverse KL(π ‖ π_teacher) at each response token, by one of two estimators:
    `sampled`, the sampled token's log-ratio as a per-token advantage (a teacher worker scores the tokens; any actor
    strategy), or `exact`, the full-vocabulary KL from both models' hidden states (rltrain_kernels linear_kl_div, no
    logits materialised) added to the actor's loss (the teacher in the actor's process; actor.strategy=single)."""
    teacher_path: str | None = None  # a transformers model with the policy's tokenizer; null = no distillation
    coef: float = 1.0                # weight of the reverse-KL term
    kl: str = "sampled"              # sampled | exact

    @property
    def enabled(self) -> bool:
        return self.teacher_path is not None

    @property
    def exact(self) -> bool:
        return self.enabled and self.kl == "exact"

    def validate(self):
        require(self.teacher_path is None or os.path.isfile(os.path.join(self.teacher_path, "config.json")),
                "teacher_path", "must be a transformers model directory (it has no config.json)", self.teacher_path)
        require(self.coef > 0, "coef", "must be > 0", self.coef)
        require(self.kl in DISTILL_KL, "kl", f"must be one of {', '.join(DISTILL_KL)}", self.kl)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"           # grpo | drgrpo | rloo | reinforce_pp | gae (PPO: a critic's values)
    loss: LossConfig = field(default_factory=LossConfig)
    kl_in_reward: bool = False            # REINFORCE++: −loss.kl_coef·k1 in each token's reward, not in the loss
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # that penalty's β: fixed or adaptive
    gamma: float = 1.0                    # reinforce_pp, gae: discount of the token rewards' returns
    lam: float = 1.0                      # gae: λ, the advantages' trade of bias (0) for variance (1)
    dynamic_sampling: bool = False        # DAPO: drop groups whose rewards are all equal, refill the batch
    dynamic_sampling_max_rounds: int = 4  # extra generation rounds allowed to refill one batch
    overlong_filter: bool = False         # DAPO: mask out truncated responses (no <eos> within max_new_tokens)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO: soft punishment
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)  # TIS / MIS
    old_logprobs: str = "auto"            # actor (recomputed before the update) | rollout (the sampling engine's) |
                                          # auto: see resolved_old_logprobs
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher

    def resolved_old_logprobs(self, mode: str, single_update: bool) -> str:
        """`auto`: rollout in the asynchronous modes (trainer.mode one_step_off / async) unless the user chose a
        behaviour correction (loss.decoupled, rollout_correction.mode), else actor. Measured on the embedded default
        (100 steps, 2 GPUs): one_step_off +4.0 / +8.5 held-out points with actor (seeds 0, 1), +47.0 with rollout,
        sync +37.5; the decoupled objective +32.5 (async). In sync mode, where the update is one optimizer step
        (`single_update`: actor.ppo_epochs 1, one mini-batch) and nothing reads π_old before it
        (`reads_old_before_update`), `update`: π_old is the policy being trained, its log-probs those of the
        update's own forward, which saves the recompute (10% of a Qwen3-1.7B step on one GPU)."""
        if self.old_logprobs != "auto":
            return self.old_logprobs
        corrected = self.loss.decoupled or self.rollout_correction.mode is not None
        if mode != "sync":
            return "actor" if corrected else "rollout"
        return "update" if single_update and not self.reads_old_before_update() else "actor"

    def reads_old_before_update(self) -> list[str]:
        """The settings (keys with values) that read π_old's log-probs before the actor's update: the in-reward KL
        penalty, sampled distillation's advantage term, the rollout corrections."""
        readers = ["algorithm.kl_in_reward=true"] if self.kl_in_reward else []
        if self.distill.enabled and not self.distill.exact:
            readers.append("algorithm.distill.kl=sampled")
        if self.rollout_correction.mode is not None:
            readers.append(f"algorithm.rollout_correction.mode={self.rollout_correction.mode}")
        if self.loss.decoupled:
            readers.append("algorithm.loss.decoupled=true")
        return readers

    def behaviour_readers(self, old_logprobs: str) -> list[str]:
        """The settings (keys with values) that read the rollout engine's log-probs as the behaviour policy's, with
        old_logprobs resolved (resolved_old_logprobs)."""
        readers = ["algorithm.old_logprobs=rollout"] if old_logprobs == "rollout" else []
        if self.rollout_correction.mode is not None:
            readers.append(f"algorithm.rollout_correction.mode={self.rollout_correction.mode}")
        if self.loss.decoupled:
            readers.append("algorithm.loss.decoupled=true")
        return readers

    def actor_loss(self, max_new_tokens: int) -> LossConfig:
        """The loss the actor trains with: Dr.GRPO's constant length resolved (norm_len, by default the generation
        budget rollout.max_new_tokens, so the normaliser is the same at every step), and no KL term when the KL
        penalty goes into the reward (kl_in_reward)."""
        loss = self.loss
        if loss.loss_agg == "seq-mean-token-sum-norm" and loss.norm_len is None:
            loss = replace(loss, norm_len=max_new_tokens)
        return replace(loss, kl_coef=0.0) if self.kl_in_reward else loss

    def validate(self):
        require(self.adv_estimator in ADVANTAGES, "adv_estimator",
                f"unknown advantage estimator; known: {', '.join(ADVANTAGES.names())}", self.adv_estimator)
        require(not self.kl_in_reward or self.loss.kl_coef > 0, "kl_in_reward",
                "needs loss.kl_coef > 0 (the penalty's coefficient β)", self.kl_in_reward)
        require(not self.kl_ctrl.adaptive or self.kl_in_reward, "kl_ctrl.type",
                "adaptive steers the in-reward KL penalty: needs kl_in_reward=true (e.g. algorithm=reinforce_pp)",
                self.kl_ctrl.type)
        require(0 < self.gamma <= 1, "gamma", "must be in (0, 1]", self.gamma)
        require(self.gamma == 1 or self.adv_estimator in ("reinforce_pp", "gae"), "gamma",
                "applies to adv_estimator=reinforce_pp or gae only", self.gamma)
        require(0 <= self.lam <= 1, "lam", "must be in [0, 1]", self.lam)
        require(self.lam == 1 or self.adv_estimator == "gae", "lam", "applies to adv_estimator=gae only", self.lam)
        require(not self.kl_in_reward or self.adv_estimator in ("reinforce_pp", "gae"), "kl_in_reward",
                "needs adv_estimator=reinforce_pp or gae (the estimators that take per-token rewards)",
                self.kl_in_reward)
        require(self.dynamic_sampling_max_rounds >= 0, "dynamic_sampling_max_rounds", "must be >= 0",
                self.dynamic_sampling_max_rounds)
        require(self.old_logprobs in OLD_LOGPROBS, "old_logprobs", f"must be one of {', '.join(OLD_LOGPROBS)}",
                self.old_logprobs)
        require(not self.loss.decoupled or self.old_logprobs != "rollout", "loss.decoupled",
                "needs algorithm.old_logprobs=actor: the proximal policy it clips against is the actor's recomputed "
                "one (with old_logprobs=rollout it would be the behaviour policy itself, every weight 1)",
                self.loss.decoupled)
