"""A run's reward failures: the counts a step logs (reward/errors and by kind) and the check that stops a run whose
reward function keeps failing, instead of training on zeros to the end and saving the result.

    stats = RewardStats.of(pool.score(items)) + ...        # summed over a step's scoring rounds
    record.update(stats.metrics())                          # reward/errors, reward/timeouts, reward/worker_deaths, ...
    guard = ErrorRateGuard(0.9, window_steps=5, function="compute_score in my_reward.py")
    guard.add(stats); guard.check()                         # raises RewardsFailing past the rate: exit status 3
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# an error kind (rltrain/rewards/pool.py) -> its reward/ metric and how the stop message says it
KINDS = {"error": (None, "raised an exception or returned a non-number"),
         "timeout": ("reward/timeouts", "timed out"),
         "memory": ("reward/memory_errors", "ran out of memory"),
         "worker_died": ("reward/worker_deaths", "killed their worker process")}


class RewardsFailing(RuntimeError):
    """The reward function failed on more than reward.max_error_rate of the samples: the run stops (exit 3)."""


@dataclass
class RewardStats:
    """How scoring went for some samples; `+` sums two (a step's rounds)."""
    samples: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)      # error kind -> samples
    examples: dict[str, str] = field(default_factory=dict)   # error kind -> its first failure message
    output_dropped_bytes: int = 0

    @classmethod
    def of(cls, result) -> RewardStats:
        """From a RewardResult."""
        return cls(len(result.scores), result.errors, dict(result.error_kinds), dict(result.examples),
                   result.output_dropped_bytes)

    def __add__(self, other: RewardStats) -> RewardStats:
        kinds = dict(self.kinds)
        for kind, count in other.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + count
        return RewardStats(self.samples + other.samples, self.errors + other.errors, kinds,
                           {**other.examples, **self.examples}, self.output_dropped_bytes + other.output_dropped_bytes)

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """reward/errors (every failed sample), reward/timeouts, reward/memory_errors, reward/worker_deaths and
        reward/output_dropped_bytes; 0 when none."""
        metrics = {f"{prefix}errors": float(self.errors)}
        for kind, (key, _) in KINDS.items():
            if key is not None:
                metrics[prefix + key.removeprefix("reward/")] = float(self.kinds.get(kind, 0))
        metrics[f"{prefix}output_dropped_bytes"] = float(self.output_dropped_bytes)
        return metrics


class ErrorRateGuard:
    """Stops the run once more than `max_error_rate` of the samples scored in the last `window_steps` train steps
    (all of them, in a run's first steps) failed. `function` names the reward function in the message."""

    def __init__(self, max_error_rate: float, window_steps: int, function: str):
        self.max_error_rate, self.function = max_error_rate, function
        self.window: deque[RewardStats] = deque(maxlen=window_steps)

    @classmethod
    def for_config(cls, config) -> ErrorRateGuard:
        """From the job's RewardConfig."""
        where = f" in {config.path!r}" if config.path else " (built-in)"
        return cls(config.max_error_rate, config.error_rate_window, f"{config.name!r}{where}")

    def add(self, stats: RewardStats) -> None:
        self.window.append(stats)

    def check(self) -> None:
        total = sum(self.window, RewardStats())
        if not total.samples or total.errors / total.samples <= self.max_error_rate:
            return
        steps = len(self.window)
        how = "; ".join(f"{count} {KINDS.get(kind, (None, kind))[1]}" +
                        (f" (e.g. {total.examples[kind]!r})" if kind in total.examples else "")
                        for kind, count in sorted(total.kinds.items(), key=lambda kv: -kv[1]))
        raise RewardsFailing(
            f"reward function {self.function} failed on {total.errors} of {total.samples} samples "
            f"({100 * total.errors / total.samples:.0f}%) in the last {steps} step{'s' * (steps > 1)}, above "
            f"reward.max_error_rate={self.max_error_rate:g}: {how}. Fix the function (the log above shows its first "
            f"failures with their output), or raise reward.max_error_rate (1 never stops).")
