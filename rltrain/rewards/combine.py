"""The step's reward beyond the reward function: reward.model's and reward.judge's scores blended into it. Each
blend is rule_weight · the reward so far + weight · the scores, and each sample's parts join its extras (the
reward/<part>_mean metrics)."""

from __future__ import annotations

import logging

import ray
import torch

logger = logging.getLogger(__name__)


def blend(before: torch.Tensor, scores: torch.Tensor, config, extras: list[dict], **parts: list) -> torch.Tensor:
    """config.rule_weight · before + config.weight · scores; parts (name -> one value per sample) into extras."""
    for i, extra in enumerate(extras):
        extra.update({name: values[i] for name, values in parts.items()})
    return config.rule_weight * before + config.weight * scores


def add_model_scores(reward_model, config, before: torch.Tensor, extras: list[dict], rows, texts: list[str],
                     messages) -> torch.Tensor:
    """reward.model (`config`): the RewardModelWorker's scores of each (prompt, response or episode)."""
    scores = ray.get(reward_model.score.remote([row.prompt for row in rows], texts, messages))
    return blend(before, scores, config, extras, rule=before.tolist(), model=scores.tolist())


def add_judge_scores(judge, config, before: torch.Tensor, extras: list[dict], rows, texts: list[str]) -> torch.Tensor:
    """reward.judge (`config`): the JudgeWorker's verdicts; a batch past config.timeout_s scores 0, each sample
    counted as a failed verdict (reward/judge_failed_mean)."""
    ref = judge.score.remote([row.prompt for row in rows], texts, [row.ground_truth for row in rows])
    try:
        scores, failed = ray.get(ref, timeout=config.timeout_s)
    except ray.exceptions.GetTimeoutError:
        logger.warning("reward.judge: no verdicts within reward.judge.timeout_s=%s s; the batch's %d samples score 0",
                       config.timeout_s, len(rows))
        scores, failed = torch.zeros(len(rows)), torch.ones(len(rows), dtype=torch.bool)
    return blend(before, scores, config, extras, judge=scores.tolist(), judge_failed=failed.float().tolist())
