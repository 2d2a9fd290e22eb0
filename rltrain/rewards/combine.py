"""The step's reward: the reward function's, with reward.model's and reward.judge's scores blended into it, all three
requested at once. Each blend is rule_weight · the reward so far + weight · the scores, and each sample's parts join
its extras (the reward/<part>_mean metrics)."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import ray
import torch

logger = logging.getLogger(__name__)


class Scorers(NamedTuple):
    """The job's scoring actors: the RewardWorker, and the reward model's and the judge's workers (None when the job
    has no reward.model / reward.judge)."""

    reward: Any
    reward_model: Any = None
    judge: Any = None


def blend(before: torch.Tensor, scores: torch.Tensor, config, extras: list[dict], **parts: list) -> torch.Tensor:
    """config.rule_weight · before + config.weight · scores; parts (name -> one value per sample) into extras."""
    for i, extra in enumerate(extras):
        extra.update({name: values[i] for name, values in parts.items()})
    return config.rule_weight * before + config.weight * scores


def score_batch(scorers: Scorers, config, texts: list[str], rows, messages, env_rewards):
    """(rewards [B], extras, RewardStats) of one batch of responses (`texts`: response_texts): the reward
    function's (`scorers.reward`), then blended with the reward model's and the judge's scores where the job has
    them. All three are asked at once, each working in its own process, so the model-based scores (GPU) overlap the
    function's (CPU pool)."""
    started = time.monotonic()
    function = scorers.reward.score.remote(texts, rows, messages, env_rewards)
    model = None if scorers.reward_model is None else \
        scorers.reward_model.score.remote([row.prompt for row in rows], texts, messages)
    verdicts = None if scorers.judge is None else \
        scorers.judge.timed_score.remote([row.prompt for row in rows], texts, [row.ground_truth for row in rows])
    rewards, extras, errors = ray.get(function)
    if model is not None:
        scores = ray.get(model)
        rewards = blend(rewards, scores, config.model, extras, rule=rewards.tolist(), model=scores.tolist())
    if verdicts is not None:
        scores, failed = judge_verdicts(verdicts, config.judge, len(rows), started)
        rewards = blend(rewards, scores, config.judge, extras, judge=scores.tolist(),
                        judge_failed=failed.float().tolist())
    return rewards, extras, errors


def judge_verdicts(ref, config, size: int, started: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reward.judge (`config`): the JudgeWorker's (scores, failed); verdicts that took longer than config.timeout_s,
    or that have not come config.timeout_s after `started` (when they were asked for), score 0, each sample counted
    as a failed verdict (reward/judge_failed_mean). Judged by the judge's own time, not by when the trainer looks,
    so the outcome does not depend on how long the reward function took beside it."""
    try:
        scores, failed, seconds = ray.get(ref, timeout=max(config.timeout_s - (time.monotonic() - started), 0.0))
        if seconds <= config.timeout_s:
            return scores, failed
    except ray.exceptions.GetTimeoutError:
        pass
    logger.warning("reward.judge: no verdicts within reward.judge.timeout_s=%s s; the batch's %d samples score 0",
                   config.timeout_s, size)
    return torch.zeros(size), torch.ones(size, dtype=torch.bool)
