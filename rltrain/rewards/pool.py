"""Run a reward function over a batch in worker processes, with a per-sample timeout.

A sample whose function raises, runs past `timeout_s`, or returns something that is not a finite number (or a dict
without one under "score") scores 0.0 and is counted in `RewardResult.errors`; each distinct failure is logged
once, with the exception. The run goes on.

Timeouts: each worker arms a timer (SIGALRM) around every call, so a Python-level hang (sleep, a loop) is
interrupted after exactly `timeout_s` of that sample's own run time. A hang that never returns to the interpreter
(a C extension spinning) is caught by a batch deadline instead, after which the pool is killed and rebuilt; the
samples still pending then are scored as timeouts.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import signal
import time
from dataclasses import dataclass, field

from rltrain.rewards.plugin import load_reward_fn

logger = logging.getLogger(__name__)


@dataclass
class RewardInput:
    data_source: str
    solution_str: str
    ground_truth: object
    extra_info: dict | None = None


@dataclass
class RewardResult:
    scores: list[float]
    metrics: list[dict[str, float]]          # extra numeric entries of dict-returning functions, per sample
    errors: int = 0                          # samples that raised, timed out or returned a non-number
    error_kinds: dict[str, int] = field(default_factory=dict)


class _SampleTimeout(Exception):
    pass


_worker_fn = None


def _init_worker(path: str | None, name: str) -> None:
    global _worker_fn
    _worker_fn = load_reward_fn(path, name)


def _on_alarm(signum, frame):
    raise _SampleTimeout()


def _score_one(item: RewardInput, timeout_s: float):
    """Runs in a worker: ('ok', score, metrics) | ('error', message) | ('timeout', message)."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        value = _worker_fn(item.data_source, item.solution_str, item.ground_truth, extra_info=item.extra_info)
    except _SampleTimeout:
        return ("timeout", f"timed out after {timeout_s:g} s")
    except Exception as exc:
        return ("error", f"raised {type(exc).__name__}: {exc}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return _as_score(value)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def _as_score(value):
    if _is_number(value):
        return ("ok", float(value), {})
    if isinstance(value, dict) and _is_number(value.get("score")):
        extras = {k: float(v) for k, v in value.items() if k != "score" and _is_number(v)}
        return ("ok", float(value["score"]), extras)
    return ("error", f"returned {type(value).__name__} {str(value)[:80]!r}, not a finite number or a dict with "
                     f"a numeric 'score'")


def check_reward_settings(path: str | None, name: str, timeout_s: float, num_workers: int) -> None:
    """The reward settings' checks, written once: the config's reward section runs them before Ray starts (importing
    the plugin, so a bad file or name fails there), the pool when it is built. Errors start with the key to fix
    (`reward.timeout_s: ...`; the plugin's: `reward.path: ...`, `reward.name: ...`)."""
    if timeout_s <= 0:
        raise ValueError(f"reward.timeout_s: must be > 0 (got {timeout_s!r})")
    if num_workers < 1:
        raise ValueError(f"reward.num_workers: must be >= 1 (got {num_workers!r})")
    load_reward_fn(path, name)


class RewardPool:
    """`RewardPool(path, name, timeout_s=10, num_workers=2).score(items) -> RewardResult`. Close it when done
    (or use it as a context manager)."""

    def __init__(self, path: str | None, name: str, timeout_s: float = 10.0, num_workers: int = 2):
        check_reward_settings(path, name, timeout_s, num_workers)  # fail here, not inside a worker
        self.path, self.name, self.timeout_s, self.num_workers = path, name, timeout_s, num_workers
        self._logged: set[str] = set()
        self._pool = None

    def _start(self):
        if self._pool is None:
            ctx = mp.get_context("spawn")  # safe inside Ray actors and threaded parents
            self._pool = ctx.Pool(self.num_workers, initializer=_init_worker, initargs=(self.path, self.name))
        return self._pool

    def score(self, items: list[RewardInput]) -> RewardResult:
        pool = self._start()
        pending = [pool.apply_async(_score_one, (item, self.timeout_s)) for item in items]
        waves = math.ceil(len(items) / self.num_workers)
        deadline = time.monotonic() + waves * self.timeout_s + 2.0  # + margin for process start-up
        result = RewardResult(scores=[0.0] * len(items), metrics=[{} for _ in items])
        killed = False
        for i, handle in enumerate(pending):
            try:
                outcome = handle.get(timeout=max(0.0, deadline - time.monotonic()))
            except mp.TimeoutError:
                outcome, killed = ("timeout", f"did not return within the batch deadline "
                                              f"({self.timeout_s:g} s per sample)"), True
            except Exception as exc:  # the sample could not be sent to or read back from the worker
                outcome = ("error", f"failed in the worker pool: {type(exc).__name__}: {exc}")
            if outcome[0] == "ok":
                result.scores[i], result.metrics[i] = outcome[1], outcome[2]
            else:
                self._record_error(result, i, items[i], outcome)
        if killed:
            self.close()
        return result

    def _record_error(self, result: RewardResult, index: int, item: RewardInput, outcome) -> None:
        kind, message = outcome
        result.errors += 1
        result.error_kinds[kind] = result.error_kinds.get(kind, 0) + 1
        if message not in self._logged:
            self._logged.add(message)
            logger.warning("reward function %r %s (sample %d of the batch, data_source %r); scored 0. "
                           "Further identical failures are counted in reward/errors, not logged.",
                           self.name, message, index, item.data_source)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
