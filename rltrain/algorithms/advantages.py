"""Advantage estimators for outcome-reward RL, as a registry: `ADVANTAGES.get(name)(rewards, response_mask, group_ids)`.

Every estimator takes one scalar reward per response (`rewards [B]`), the response token mask (`[B, T]`) and the
group id of each response (`[B]`, responses sampled from the same prompt share one), and returns per-token
advantages `[B, T]` (zero where the mask is zero). With G responses r_1..r_G in a group:

- `grpo`:         A_i = (r_i − mean(r)) / (std(r) + eps)            (std unbiased, as in the GRPO paper / verl)
- `drgrpo`:       A_i = r_i − mean(r)                                (Dr.GRPO: no std normalisation; pair it with
                                                                     loss_agg="seq-mean-token-sum-norm")
- `rloo`:         A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean(r))   (leave-one-out baseline)
- `reinforce_pp`: REINFORCE++: the reward sits on the last response token, returns are reverse cumulative sums
                  (γ = 1), so every token of a response gets r_i; they are whitened over all response tokens of
                  the batch (mean 0, std 1), no critic and no group baseline.

Groups of one response get advantage 0 under grpo/drgrpo/rloo (no baseline exists).
"""

from __future__ import annotations

import torch

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


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards, response_mask, group_ids):
    _check(rewards, response_mask, group_ids)
    mask = response_mask.to(torch.float64)
    # reward on the last valid token, then reverse cumulative sum with gamma = 1
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    token_rewards = torch.where(last, rewards.double().unsqueeze(1), torch.zeros_like(mask))
    returns = token_rewards.flip(1).cumsum(1).flip(1) * mask
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(mask, dtype=torch.float32)
    mean = (returns * mask).sum() / n
    var = (((returns - mean) * mask) ** 2).sum() / (n - 1)
    return ((returns - mean) * torch.rsqrt(var + EPS) * mask).to(torch.float32)


def compute_advantages(name: str, rewards, response_mask, group_ids) -> torch.Tensor:
    return ADVANTAGES.get(name)(rewards, response_mask, group_ids)
