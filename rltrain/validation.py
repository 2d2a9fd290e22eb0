"""Validation metrics, as RL papers report them: with n samples per held-out prompt (`trainer.val_n`, sampled at
`rollout.val_temperature`; greedy n = 1 by default), the mean reward over all samples (`val/mean@n`) and the
unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code") for
k = 1, 2, 4, ... and n (`val/pass@k`), overall and per data source (`val/<data_source>/...`).

A sample passes when its reward is >= 1 (PASS_REWARD): a correct answer under the built-in rewards (1 or 0), under
±1 rewards and under a correctness reward with a format bonus on top (examples/rewards/).

    metrics = validation_metrics(rewards, n, data_sources)   # rewards [P·n], prompt-major; data_sources: P strings
"""

from __future__ import annotations

import math

import torch

PASS_REWARD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of which pass, passes) =
    1 − C(n − c, k) / C(n, k), as a product (no large binomials)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: the powers of two below n, and n."""
    return sorted({2 ** j for j in range(n.bit_length()) if 2 ** j < n} | {n})


def _metrics(rewards: torch.Tensor, n: int, prefix: str) -> dict[str, float]:
    """rewards [P, n] of P prompts."""
    passed = (rewards >= PASS_REWARD).sum(1).tolist()
    metrics = {f"{prefix}mean@{n}": rewards.double().mean().item()}
    for k in pass_ks(n):
        metrics[f"{prefix}pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(passed)
    metrics[f"{prefix}count"] = len(passed)
    return metrics


def validation_metrics(rewards: torch.Tensor, n: int, data_sources: list[str]) -> dict[str, float]:
    """val/mean@n, val/pass@k and val/count (prompts), then the same under val/<data_source>/ for each source.
    rewards: [P·n], the n samples of each prompt consecutive; data_sources: each prompt's."""
    per_prompt = rewards.view(-1, n)
    if per_prompt.shape[0] != len(data_sources):
        raise ValueError(f"{per_prompt.shape[0]} prompts of {n} samples but {len(data_sources)} data sources")
    metrics = _metrics(per_prompt, n, "val/")
    for source in sorted(set(data_sources)):
        rows = torch.tensor([s == source for s in data_sources])
        metrics.update(_metrics(per_prompt[rows], n, f"val/{source}/"))
    return metrics
