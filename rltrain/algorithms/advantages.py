"""Advantage estimators for outcome-reward RL, as a registry: `ADVANTAGES.get(name)(rewards, response_mask, group_ids)`.

Every estimator takes one scalar reward per response (`rewards [B]`), the response token mask (`[B, T]`) and the
group id of each response (`[B]`, responses sampled from the same prompt share one), and returns per-token
advantages `[B, T]` (zero where the mask is zero). With G responses r_1..r_G in a group:

- `grpo`:         A_i = (r_i − mean(r)) / (std(r) + eps)            (std unbiased, as in the GRPO paper / verl)
- `drgrpo`:       A_i = r_i − mean(r)                                (Dr.GRPO: no std normalisation; pair it with
                                                                     loss_agg="seq-mean-token-sum-norm")
- `rloo`:         A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean(r))   (leave-one-out baseline)
- `gae`:          PPO's generalised advantage estimation (Schulman et al., 2016) against a learned critic's values
                  V_t (rltrain/workers/critic.py): token rewards as reinforce_pp's, δ_t = r_t + γ·V_{t+1} − V_t,
                  A_t = Σ_l (γλ)^l δ_{t+l} (algorithm.gamma, algorithm.lam), returns A_t + V_t as the critic's
                  targets, advantages whitened over the batch's response tokens; no group baseline. Masked tokens
                  inside a response (a tool's output) are skipped: the next state is the next kept token's.
- `reinforce_pp`: REINFORCE++ (Hu, 2025): token rewards r_t = r_i on the response's last token plus, with
                  `token_rewards`, a per-token term (algorithm.kl_in_reward: −β·k1, k1 = log π_old − log π_ref),
                  returns G_t = r_t + γ·G_{t+1} (algorithm.gamma, 1 by default: every token gets r_i plus the
                  penalties from it on), whitened over all response tokens of the batch (mean 0, std 1); no critic
                  and no group baseline.

Groups of one response get advantage 0 under grpo/drgrpo/rloo (no baseline exists).

`batch_advantages(batch, algorithm)` is what the trainer calls: the configured estimator with REINFORCE++'s KL
penalty in the reward (`kl_reward`) and discount where the algorithm config asks for them, plus on-policy
distillation's per-token term (`distill_advantages`, algorithm.distill) added to whatever the estimator gives.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rltrain.algorithms.kl_control import batch_kl
from rltrain.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
EPS = 1e-6


def _check(rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"response_mask must be [B, T] with B={rewards.shape[0]}, got {tuple(response_mask.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must be [B]={tuple(rewards.shape)}, got {tuple(group_ids.shape)}")


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-response group mean, unbiased group std and group size (fp64 math, vectorised over groups)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return mean[inverse], std[inverse], counts[inverse]


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_sequence.to(torch.float32).unsqueeze(1) * response_mask.to(torch.float32)


GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")   # compare a prompt's responses: a group needs two or more


@ADVANTAGES.register("grpo")
def grpo(rewards, response_mask, group_ids):
    _check(rewards, response_mask, group_ids)
    mean, std, count = group_stats(rewards, group_ids)
    adv = torch.where(count > 1, (rewards.double() - mean) / (std + EPS), torch.zeros_like(mean))
    return _broadcast(adv, response_mask)


@ADVANTAGES.register("drgrpo")
def drgrpo(rewards, response_mask, group_ids):
    _check(rewards, response_mask, group_ids)
    mean, _, count = group_stats(rewards, group_ids)
    adv = torch.where(count > 1, rewards.double() - mean, torch.zeros_like(mean))
    return _broadcast(adv, response_mask)


@ADVANTAGES.register("rloo")
def rloo(rewards, response_mask, group_ids):
    _check(rewards, response_mask, group_ids)
    mean, _, count = group_stats(rewards, group_ids)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scale * (rewards.double() - mean), torch.zeros_like(mean))
    return _broadcast(adv, response_mask)


def token_level_rewards(rewards: torch.Tensor, response_mask: torch.Tensor,
                        token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] fp64: each response's outcome reward on its last kept token, plus the per-token terms where given."""
    mask = response_mask.to(torch.float64)
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    per_token = torch.where(last, rewards.double().unsqueeze(1), torch.zeros_like(mask))
    return per_token if token_rewards is None else per_token + token_rewards.double() * mask


def whiten(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(values − mean) / std over the masked tokens of the batch ([B, T] fp32, 0 where masked; zeros with fewer than
    two tokens)."""
    mask = response_mask.to(torch.float64)
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(mask, dtype=torch.float32)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1)
    return ((values - mean) * torch.rsqrt(var + EPS) * mask).to(torch.float32)


def gae_targets(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, T] fp64, 0 where masked: GAE(γ, λ) over each response's kept tokens, a masked
    token passed over (its successor's value and advantage carry through it), V = 0 after the last."""
    mask = response_mask != 0
    rewards, values = token_rewards.double(), values.double()
    advantages = torch.zeros_like(rewards)
    running, next_value = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        kept = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(kept, step, 0.0)
        running = torch.where(kept, step, running)
        next_value = torch.where(kept, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


@ADVANTAGES.register("gae")
def gae(rewards, response_mask, group_ids, values: torch.Tensor | None = None,
        token_rewards: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0):
    """Whitened GAE advantages (gae_targets gives the returns too); needs the critic's values."""
    _check(rewards, response_mask, group_ids)
    if values is None or values.shape != response_mask.shape:
        raise ValueError(f"gae needs the critic's values [B, T]={tuple(response_mask.shape)}, got "
                         f"{None if values is None else tuple(values.shape)}")
    advantages, _ = gae_targets(token_level_rewards(rewards, response_mask, token_rewards), values, response_mask,
                                gamma, lam)
    return whiten(advantages, response_mask)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards, response_mask, group_ids, token_rewards: torch.Tensor | None = None, gamma: float = 1.0):
    _check(rewards, response_mask, group_ids)
    mask = response_mask.to(torch.float64)
    # the outcome reward on the last valid token, plus the per-token terms, then discounted returns
    per_token = token_level_rewards(rewards, response_mask, token_rewards)
    if gamma == 1.0:
        returns = per_token.flip(1).cumsum(1).flip(1)
    else:
        returns, running = torch.zeros_like(per_token), torch.zeros_like(per_token[:, 0])
        for t in range(per_token.shape[1] - 1, -1, -1):
            running = per_token[:, t] + gamma * running
            returns[:, t] = running
    return whiten(returns * mask, response_mask)


def compute_advantages(name: str, rewards, response_mask, group_ids, **options) -> torch.Tensor:
    """options: the estimator's own keywords (reinforce_pp: token_rewards, gamma; gae: values, token_rewards, gamma,
    lam)."""
    return ADVANTAGES.get(name)(rewards, response_mask, group_ids, **options)


def kl_reward(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
              kl_coef: float) -> torch.Tensor:
    """REINFORCE++'s per-token KL penalty in the reward: −β·k1 = −β·(log π_old − log π_ref) per response token
    ([B, T] fp64, 0 where masked)."""
    k1 = old_logprobs.double() - ref_logprobs.double()
    return torch.where(response_mask != 0, -kl_coef * k1, 0.0)


def batch_advantages(batch: TensorDict, algorithm, kl_coef: float | None = None) -> tuple[torch.Tensor,
                                                                                         dict[str, float]]:
    """(advantages [B, T], metrics) of a scored batch with old (and, for kl_in_reward, reference) log-probs: the
    configured estimator, with REINFORCE++'s discount and KL penalty in the reward where the config asks.
    `algorithm`: the algorithm section (AlgorithmConfig, rltrain/algorithms/config.py, which imports this module's
    registry to check adv_estimator); `kl_coef`: the penalty's β this step (algorithm.kl_ctrl), else loss.kl_coef.
    With kl_in_reward the metrics hold the batch's KL (train/kl, what an adaptive β steers) and β (train/kl_coef).
    gae reads the critic's batch["values"] and writes its targets into batch["returns"]."""
    options, metrics = {}, {}
    if algorithm.adv_estimator == "reinforce_pp":
        options["gamma"] = algorithm.gamma
    if algorithm.kl_in_reward:
        coef = algorithm.loss.kl_coef if kl_coef is None else kl_coef
        options["token_rewards"] = kl_reward(batch["old_logprobs"], batch["ref_logprobs"], batch["response_mask"],
                                             coef)
        metrics["train/kl_penalty_mean"] = options["token_rewards"].sum(1).mean().item()  # per response
        metrics["train/kl"] = batch_kl(batch["old_logprobs"], batch["ref_logprobs"], batch["response_mask"])
        metrics["train/kl_coef"] = coef
    if algorithm.adv_estimator == "gae":   # the advantages and the critic's targets from one pass
        mask = batch["response_mask"]
        raw, returns = gae_targets(token_level_rewards(batch["rewards"], mask, options.get("token_rewards")),
                                   batch["values"], mask, algorithm.gamma, algorithm.lam)
        advantages, batch["returns"] = whiten(raw, mask), returns.float()
    else:
        advantages = compute_advantages(algorithm.adv_estimator, batch["rewards"], batch["response_mask"],
                                        batch["group_ids"], **options)
    if algorithm.distill.enabled and not algorithm.distill.exact:  # exact: a term of the actor's loss instead
        term, reverse_kl = distill_advantages(batch["old_logprobs"], batch["teacher_logprobs"],
                                              batch["response_mask"], algorithm.distill.coef)
        advantages = advantages + term
        metrics["train/distill_reverse_kl"] = reverse_kl
    return advantages, metrics


def distill_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       coef: float) -> tuple[torch.Tensor, float]:
    """On-policy distillation's per-token advantage, coef·(log π_teacher − log π_old) of each sampled response token
    ([B, T] fp32, 0 where masked), and the mean over response tokens of log π_old − log π_teacher: a sample of the
    per-token reverse KL(π_old ‖ π_teacher) that the term pushes down. Each token gets its own term only (no
    returns), so the policy gradient moves every sampled token toward the teacher's log-prob of it."""
    mask = response_mask != 0
    gap = old_logprobs.double() - teacher_logprobs.double()
    tokens = int(mask.sum())
    reverse_kl = float(gap[mask].sum() / tokens) if tokens else 0.0
    return torch.where(mask, -coef * gap, 0.0).to(torch.float32), reverse_kl
