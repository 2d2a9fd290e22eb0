"""RewardWorker: scores responses (their text, response_texts) with the configured reward function in a process pool
with a per-sample timeout, a memory limit and capped output (rltrain.rewards.pool); RewardConfig, the job's reward
section."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rltrain.config import ConfigError, require
from rltrain.data.rows import PromptRow
from rltrain.rewards.health import RewardStats
from rltrain.rewards.pool import RewardInput, RewardPool, check_reward_settings
from rltrain.sandbox import SandboxConfig
from rltrain.workers.batch import response_context
from rltrain.workers.judge import JudgeConfig
from rltrain.workers.reward_model import RewardModelConfig


def response_texts(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Each response as text: the whole of it (a multi-turn episode's tool output included: response_context)."""
    context = response_context(response_mask).bool()
    return [tokenizer.decode(ids[keep].tolist(), skip_special_tokens=True) for ids, keep in zip(response_ids, context)]


@dataclass
class RewardConfig:
    path: str | None = None   # a Python file with the reward function; null = a built-in
    name: str = "default"     # the function in `path`, or a built-in: default, math, arithmetic
    timeout_s: float = 10.0   # per sample; past it the sample scores 0 and counts in reward/errors
    num_workers: int = 2
    max_error_rate: float = 0.9    # more failed samples than this over the window stops the run (exit 3); 1 = never
    error_rate_window: int = 5     # train steps the error rate is taken over
    max_output_bytes: int = 4096   # of the function's stdout/stderr, kept per sample and shown per batch
    memory_limit_mb: int = 8192    # per worker process (RLIMIT_DATA); 0 = none
    model: RewardModelConfig = field(default_factory=RewardModelConfig)   # a reward model beside the function
    judge: JudgeConfig = field(default_factory=JudgeConfig)   # a generative judge (an LLM's verdict) beside them
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)   # where the `code` reward runs programs

    def validate(self):
        require(0 <= self.max_error_rate <= 1, "max_error_rate", "must be in [0, 1]", self.max_error_rate)
        require(self.error_rate_window >= 1, "error_rate_window", "must be >= 1", self.error_rate_window)
        try:  # the pool's checks, the plugin imported once here, so a bad file or name fails before Ray starts
            check_reward_settings(self.path, self.name, self.timeout_s, self.num_workers, self.max_output_bytes,
                                  self.memory_limit_mb, self.sandbox)
        except (OSError, ImportError, ValueError) as err:  # their messages start with the key (reward.path: ...)
            raise ConfigError(str(err)) from None


class RewardWorker:
    def __init__(self, config: RewardConfig):
        self.pool = RewardPool(config.path, config.name, config.timeout_s, config.num_workers,
                               config.max_output_bytes, config.memory_limit_mb, config.sandbox)

    def score(self, texts: list[str], rows: list[PromptRow], messages: list[list[dict]] | None = None,
              env_rewards: list[float] | None = None):
        """texts[i] is response i (response_texts: the whole of it, a multi-turn episode's tool output included),
        rows[i] its prompt row. Returns (rewards [B], per-sample metrics, RewardStats). messages (multi-turn): each
        episode's chat messages, passed to the reward function as extra_info["messages"]; env_rewards (an
        environment's or agent's episodes): each one's reward, as extra_info["env_reward"] (NaN: an agent's episode
        without one, whose extra_info has no env_reward)."""
        infos = [row.extra_info for row in rows] if messages is None else \
            [{**(row.extra_info or {}), "messages": episode} for row, episode in zip(rows, messages)]
        if env_rewards is not None:
            infos = [info if math.isnan(reward) else {**(info or {}), "env_reward": reward}
                     for info, reward in zip(infos, env_rewards)]
        items = [RewardInput(row.data_source, text, row.ground_truth, info)
                 for row, text, info in zip(rows, texts, infos)]
        result = self.pool.score(items)
        return torch.tensor(result.scores, dtype=torch.float32), result.metrics, RewardStats.of(result)

    def close(self) -> None:
        self.pool.close()
