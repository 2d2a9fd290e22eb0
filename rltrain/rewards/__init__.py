"""Rewards: plug-in reward functions (a Python file + function name, verl's signature), built-in scorers, and the
process pool that runs them with a per-sample timeout."""

from rltrain.rewards.plugin import RewardFn, load_reward_fn
from rltrain.rewards.pool import RewardInput, RewardPool, RewardResult

__all__ = ["RewardFn", "RewardInput", "RewardPool", "RewardResult", "load_reward_fn"]
