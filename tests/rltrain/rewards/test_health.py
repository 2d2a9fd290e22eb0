"""Reward failures over a run: RewardStats summed over a step's rounds into its reward/* metrics, and the error-rate
guard that stops a run whose function keeps failing (reward.max_error_rate over reward.error_rate_window steps)."""

import pytest

from rltrain.rewards.health import ErrorRateGuard, RewardsFailing, RewardStats
from rltrain.workers.reward import RewardConfig


def _failing(samples: int, errors: int, kind: str = "error", example: str = "raised ValueError: no answer"):
    return RewardStats(samples, errors, {kind: errors} if errors else {}, {kind: example} if errors else {})


def test_stats_sum_over_rounds_into_metrics():
    rounds = _failing(16, 3, "timeout", "timed out after 10 s") + _failing(16, 2, "worker_died", "killed its worker") \
        + RewardStats(16, 1, {"timeout": 1}, {"timeout": "a later message"}, output_dropped_bytes=500)
    assert (rounds.samples, rounds.errors, rounds.kinds) == (48, 6, {"timeout": 4, "worker_died": 2})
    assert rounds.examples["timeout"] == "timed out after 10 s"   # the first one seen
    assert rounds.metrics() == {"reward/errors": 6.0, "reward/timeouts": 4.0, "reward/memory_errors": 0.0,
                                "reward/worker_deaths": 2.0, "reward/output_dropped_bytes": 500.0}
    assert RewardStats().metrics()["reward/errors"] == 0.0


def test_guard_stops_past_the_rate_over_its_window():
    guard = ErrorRateGuard(0.5, window_steps=2, function="'score' in '/r.py'")
    guard.add(_failing(16, 8))
    guard.check()                      # exactly the rate: goes on
    guard.add(_failing(16, 16))        # 24 of 32 over the last 2 steps
    with pytest.raises(RewardsFailing) as stopped:
        guard.check()
    assert str(stopped.value) == (
        "reward function 'score' in '/r.py' failed on 24 of 32 samples (75%) in the last 2 steps, above "
        "reward.max_error_rate=0.5: 24 raised an exception or returned a non-number (e.g. 'raised ValueError: no "
        "answer'). Fix the function (the log above shows its first failures with their output), or raise "
        "reward.max_error_rate (1 never stops).")


def test_guard_window_slides():
    guard = ErrorRateGuard(0.9, window_steps=2, function="'default' (built-in)")
    for stats in (_failing(10, 0), _failing(10, 10), _failing(10, 0), _failing(10, 10)):
        guard.add(stats)
        guard.check()                  # each window: one failing step of two
    guard.add(_failing(10, 10))        # two failing steps in a row
    with pytest.raises(RewardsFailing, match=r"failed on 20 of 20 samples \(100%\) in the last 2 steps"):
        guard.check()
    first = ErrorRateGuard(0.9, window_steps=5, function="f")
    first.add(_failing(10, 10))
    with pytest.raises(RewardsFailing, match="in the last 1 step, above"):   # a run's first steps: all so far
        first.check()
    never = ErrorRateGuard(1.0, 1, "f")
    never.add(_failing(10, 10))
    never.check()                      # 1 never stops


def test_guard_names_every_kind_most_frequent_first():
    guard = ErrorRateGuard(0.4, 1, "'score' in '/r.py'")
    guard.add(_failing(10, 4, "worker_died", "killed its worker process (killed by SIGKILL)") +
              _failing(10, 6, "memory", "ran out of memory (MemoryError) under reward.memory_limit_mb=64"))
    with pytest.raises(RewardsFailing) as stopped:
        guard.check()
    assert ": 6 ran out of memory (e.g. 'ran out of memory (MemoryError) under reward.memory_limit_mb=64'); 4 killed " \
           "their worker process (e.g. 'killed its worker process (killed by SIGKILL)'). Fix" in str(stopped.value)


def test_guard_from_config_names_the_function():
    assert ErrorRateGuard.for_config(RewardConfig()).function == "'default' (built-in)"
    guard = ErrorRateGuard.for_config(RewardConfig(name="score", path="/r.py", max_error_rate=0.2,
                                                   error_rate_window=3))
    assert (guard.function, guard.max_error_rate, guard.window.maxlen) == ("'score' in '/r.py'", 0.2, 3)
