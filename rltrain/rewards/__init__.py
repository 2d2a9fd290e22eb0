"""Rewards: plug-in reward functions (a Python file + function name, verl's signature), built-in scorers, the process
pool that runs them (per-sample timeout, memory limit, captured output, dead workers replaced) and the counts and
error-rate guard over a run (health.py)."""

from rltrain.rewards.health import ErrorRateGuard, RewardsFailing, RewardStats
from rltrain.rewards.plugin import RewardFn, load_reward_fn
from rltrain.rewards.pool import RewardInput, RewardPool, RewardResult

__all__ = ["ErrorRateGuard", "RewardFn", "RewardInput", "RewardPool", "RewardResult", "RewardStats", "RewardsFailing",
           "load_reward_fn"]
