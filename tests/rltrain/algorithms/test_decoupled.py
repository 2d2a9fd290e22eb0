"""AReaL's decoupled PPO objective (algorithm.loss.decoupled; Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", eq. 5), for responses sampled by stale weights:

    J(θ) = E[ Σ_t  π_prox/π_behav · min( r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t ) ],   r_t = π_θ / π_prox

with π_prox the actor's recomputed old log-probs and π_behav the sampling engine's (rollout_logprobs). The trainer's
route — apply_rollout_correction(decoupled=True) puts the weights into the batch, the actor folds them into the
advantages, fused_policy_loss computes the clipped surrogate against old_logprobs — against that objective written
out in float64, loss and gradients; its caps through algorithm.rollout_correction (truncate: min(w, high); mask: the
tokens outside [low, high] leave the loss); and its config checks.
"""

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.rollout_correction import RolloutCorrectionConfig, apply_rollout_correction
from rltrain.config import ConfigError
from rltrain.job import load_job_config
from rltrain.workers.actor import weighted_advantages
from tests.rltrain.tiny_job import compose

B, R, H, V = 5, 7, 8, 13
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def _case(seed: int):
    """Hidden states and head in float64, labels, a mask with padding, per-token advantages, and proximal /
    behaviour log-probs far enough apart that the weights and the clip both matter."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, R, H, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, V, (B, R), generator=generator)
    mask = torch.ones(B, R, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    advantages = torch.randn(B, R, dtype=torch.float64, generator=generator) * mask
    with torch.no_grad():
        current = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]
    proximal = (current + 0.3 * torch.randn(B, R, dtype=torch.float64, generator=generator)) * mask
    behaviour = (proximal + 0.5 * torch.randn(B, R, dtype=torch.float64, generator=generator)) * mask
    return hidden, weight, labels, mask, advantages, proximal, behaviour


def _trainer_route(case, config: RolloutCorrectionConfig):
    """(loss, d loss / d hidden, d loss / d weight, the batch's response mask) as the trainer and actor compute it."""
    from rltrain_kernels import fused_policy_loss

    hidden, weight, labels, mask, advantages, proximal, behaviour = case
    batch = TensorDict({"old_logprobs": proximal, "rollout_logprobs": behaviour, "response_mask": mask.clone(),
                        "advantages": advantages}, batch_size=[B])
    apply_rollout_correction(batch, config, decoupled=True)
    out = fused_policy_loss(hidden, weight, labels, batch["response_mask"], weighted_advantages(batch), proximal,
                            clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    return out.loss.detach(), *grads, batch["response_mask"]


def _decoupled_objective(case, cap: str | None, high: float = 2.0, low: float = 0.5):
    """The loss −J(θ) above, token-mean over the kept tokens, in float64; cap: None (AReaL's weight as is),
    "truncate" (min(w, high)) or "mask" (tokens with w outside [low, high] dropped)."""
    hidden, weight, labels, mask, advantages, proximal, behaviour = case
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]
    behaviour_weight = torch.exp(proximal - behaviour)                    # π_prox / π_behav, no gradient
    ratio = torch.exp(logp - proximal)                                    # π_θ / π_prox
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantages)
    kept = mask.bool()
    if cap == "truncate":
        behaviour_weight = behaviour_weight.clamp(max=high)
    if cap == "mask":
        kept = kept & (behaviour_weight >= low) & (behaviour_weight <= high)
    loss = -(behaviour_weight * surrogate)[kept].sum() / kept.sum()
    return loss.detach(), *torch.autograd.grad(loss, (hidden, weight)), kept


@pytest.mark.parametrize("cap", [None, "truncate", "mask"], ids=["uncapped", "truncate-2", "mask-0.5-2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_trainer_route_equals_the_decoupled_objective(seed, cap):
    case = _case(seed)
    config = RolloutCorrectionConfig(cap, high=2.0, low=0.5 if cap == "mask" else None)
    loss, grad_hidden, grad_weight, response_mask = _trainer_route(case, config)
    want_loss, want_hidden, want_weight, kept = _decoupled_objective(case, cap)
    assert torch.equal(response_mask.bool(), kept)
    # the batch holds the weights in fp32 (rollout_is_weights), the rest is float64: 2^-24 relative per weight,
    # so the relative error of the loss and of each gradient (as a whole: its entries are sums that cancel)
    torch.testing.assert_close(loss, want_loss, rtol=2e-7, atol=0)
    for got, want in ((grad_hidden, want_hidden), (grad_weight, want_weight)):
        assert (got - want).norm() <= 2e-7 * want.norm()
    # the behaviour weight matters: plain PPO against π_prox gives another loss
    plain = _trainer_route(case, RolloutCorrectionConfig())[0] if cap is None else None
    if plain is not None:
        from rltrain_kernels import fused_policy_loss

        hidden, weight, labels, mask, advantages, proximal, _ = case
        ppo = fused_policy_loss(hidden, weight, labels, mask, advantages, proximal, clip_low=CLIP_LOW,
                                clip_high=CLIP_HIGH).loss.detach()
        assert not torch.allclose(ppo, want_loss, rtol=1e-3)


def test_decoupled_weights_are_the_uncapped_ratio_and_logged():
    hidden, weight, labels, mask, advantages, proximal, behaviour = _case(2)
    batch = TensorDict({"old_logprobs": proximal, "rollout_logprobs": behaviour, "response_mask": mask},
                       batch_size=[B])
    metrics = apply_rollout_correction(batch, RolloutCorrectionConfig(), decoupled=True)
    ratio = torch.exp(proximal - behaviour)
    torch.testing.assert_close(batch["rollout_is_weights"], torch.where(mask.bool(), ratio, 1.0).float())
    assert metrics["rollout/is_ratio_max"] > 2.0   # nothing capped it
    assert metrics["rollout/is_weight_mean"] == pytest.approx(ratio[mask.bool()].mean().item(), rel=1e-6)
    off = TensorDict({"old_logprobs": proximal, "rollout_logprobs": behaviour, "response_mask": mask}, batch_size=[B])
    apply_rollout_correction(off, RolloutCorrectionConfig())
    assert "rollout_is_weights" not in off.keys()   # decoupled off, no mode: plain PPO


@pytest.mark.parametrize("overrides, message", [
    ("algorithm.old_logprobs=engine", "algorithm.old_logprobs: must be one of auto, actor, rollout, update (got 'engine')"),
    ("algorithm.old_logprobs=rollout algorithm.loss.decoupled=true",
     "algorithm.loss.decoupled: needs algorithm.old_logprobs=actor: the proximal policy it clips against is the "
     "actor's recomputed one"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_job_config(compose(*overrides.split()))
    assert str(err.value).startswith(message), err.value


def test_the_engine_reports_log_probs_when_the_loss_needs_them():
    """The hf engine reports rollout_logprobs for old_logprobs=rollout, decoupled and the off-policy modes; the
    kernel never sees `decoupled` (it is not one of its options)."""
    for overrides in (["algorithm.old_logprobs=rollout"], ["algorithm.loss.decoupled=true"],
                      ["trainer.mode=one_step_off"]):
        job = load_job_config(compose(*overrides))
        assert job.rollout_reports_logprobs, overrides
        assert "decoupled" not in job.algorithm.loss.kernel_options()
    assert not load_job_config(compose()).rollout_reports_logprobs
