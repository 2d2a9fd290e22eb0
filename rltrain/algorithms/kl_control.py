"""The coefficient β of the in-reward KL penalty (algorithm.kl_in_reward), fixed or adaptive (algorithm.kl_ctrl).

Adaptive is Ziegler et al. (2019)'s controller, as verl runs it: after each step, with the batch's KL (the mean over
responses of each response's mean per-token k1 = log π_old − log π_ref) and n its responses,

    error = clip(KL / target_kl − 1, −0.2, 0.2);   β ← β · (1 + error · n / horizon)

so β grows while the policy drifts past target_kl from the reference and shrinks while it stays closer; a step moves
it by at most 20% · n / horizon. The step's penalty uses the β from before the step's update. β is part of the
checkpoint (trainer_state.json), so a resumed run continues it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.config import require

KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class KLControlConfig:
    type: str = "fixed"        # fixed: β = loss.kl_coef throughout | adaptive: β steered toward target_kl
    target_kl: float = 0.1     # adaptive: the batch KL (mean per-token k1) β steers toward
    horizon: int = 10000       # adaptive: responses over which β may change by a factor up to 1.2

    @property
    def adaptive(self) -> bool:
        return self.type == "adaptive"

    def validate(self):
        require(self.type in KL_CONTROLLERS, "type", f"must be one of {', '.join(KL_CONTROLLERS)}", self.type)
        require(self.target_kl > 0, "target_kl", "must be > 0", self.target_kl)
        require(self.horizon >= 1, "horizon", "must be >= 1", self.horizon)


def batch_kl(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """The mean over responses of each response's mean per-token k1 (log π_old − log π_ref); responses without a
    token count as 0, as in verl's masked mean."""
    mask = (response_mask != 0).double()
    k1 = (old_logprobs.double() - ref_logprobs.double()) * mask
    return float((k1.sum(1) / mask.sum(1).clamp(min=1)).mean()) if mask.shape[0] else 0.0


class KLController:
    def __init__(self, config: KLControlConfig, coef: float):
        self.config, self.coef = config, coef

    def update(self, kl: float, responses: int) -> None:
        if self.config.adaptive:
            error = min(max(kl / self.config.target_kl - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * responses / self.config.horizon

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
