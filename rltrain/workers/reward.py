"""RewardWorker: decodes responses and scores them with the configured reward function in a process pool with a
per-sample timeout (rltrain.rewards.pool)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.config import ConfigError
from rltrain.data.rows import PromptRow
from rltrain.rewards.pool import RewardInput, RewardPool, check_reward_settings
from rltrain.workers.batch import response_context


@dataclass
class RewardConfig:
    path: str | None = None   # a Python file with the reward function; null = a built-in
    name: str = "default"     # the function in `path`, or a built-in: default, math, arithmetic
    timeout_s: float = 10.0   # per sample; past it the sample scores 0 and counts in reward/errors
    num_workers: int = 2

    def validate(self):
        try:  # the pool's checks, the plugin imported once here, so a bad file or name fails before Ray starts
            check_reward_settings(self.path, self.name, self.timeout_s, self.num_workers)
        except (OSError, ImportError, ValueError) as err:  # their messages start with the key (reward.path: ...)
            raise ConfigError(str(err)) from None


class RewardWorker:
    def __init__(self, config: RewardConfig, tokenizer_path: str):
        from rltrain.workers.policy import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.pool = RewardPool(config.path, config.name, config.timeout_s, config.num_workers)

    def score(self, response_ids: torch.Tensor, response_mask: torch.Tensor, rows: list[PromptRow],
              messages: list[list[dict]] | None = None):
        """rows[i] is the prompt row of response i. Returns (rewards [B], per-sample metrics, errors, texts).
        The text is the whole response (a multi-turn episode's tool output included: response_context); messages
        (multi-turn): each episode's chat messages, passed to the reward function as extra_info["messages"]."""
        context = response_context(response_mask).bool()
        texts = [self.tokenizer.decode(ids[keep].tolist(), skip_special_tokens=True)
                 for ids, keep in zip(response_ids, context)]
        infos = [row.extra_info for row in rows] if messages is None else \
            [{**(row.extra_info or {}), "messages": episode} for row, episode in zip(rows, messages)]
        items = [RewardInput(row.data_source, text, row.ground_truth, info)
                 for row, text, info in zip(rows, texts, infos)]
        result = self.pool.score(items)
        return torch.tensor(result.scores, dtype=torch.float32), result.metrics, result.errors, texts

    def close(self) -> None:
        self.pool.close()
