"""The reward worker process's side of rltrain/rewards/pool.py: load the function, then score the samples the pool
sends, one at a time, each under a timer.

    serve(conn, output, path, name, timeout_s, memory_limit_mb, sandbox)   # the process's target; the pool starts it

Before the plug-in is imported the process points its stdout and stderr (file descriptors 1 and 2, so C code and
subprocesses too) at the `output` pipe, which the pool reads and caps, and limits its memory with RLIMIT_DATA: an
allocation past `memory_limit_mb` raises MemoryError in the function (scored as a memory breach) instead of the
kernel's out-of-memory killer taking the node's other processes. RLIMIT_DATA, not RLIMIT_AS: importing torch maps
640 MB of address space for 220 MB of data, and each thread adds 72 MB of address space (its stack and malloc arena)
but 8 MB of data.
Answers: ('ok', score, metrics) | ('error', message) | ('timeout', message) | ('memory', message); at start
('ready', '') or ('failed', kind, message).
"""

from __future__ import annotations

import math
import numbers
import os
import resource
import signal
import sys

from rltrain.process_pool import answer_jobs
from rltrain.rewards.plugin import load_reward_fn
from rltrain.sandbox import SandboxConfig


class _SampleTimeout(Exception):
    pass


_armed = False   # the timer belongs to a running sample: an alarm that lands after it returned is ignored


def _on_alarm(signum, frame):
    if _armed:
        raise _SampleTimeout()


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def as_score(value):
    if _is_number(value):
        return ("ok", float(value), {})
    if isinstance(value, dict) and _is_number(value.get("score")):
        extras = {k: float(v) for k, v in value.items() if k != "score" and _is_number(v)}
        return ("ok", float(value["score"]), extras)
    return ("error", f"returned {type(value).__name__} {str(value)[:80]!r}, not a finite number or a dict with "
                     f"a numeric 'score'")


def memory_message(memory_limit_mb: int, exc: BaseException) -> str:
    detail = f": {exc}" if str(exc) else ""
    return f"ran out of memory (MemoryError{detail}) under reward.memory_limit_mb={memory_limit_mb}"


def score_one(fn, item, timeout_s: float, memory_limit_mb: int):
    """Run fn on one RewardInput under a `timeout_s` timer (SIGALRM interrupts Python code, not a C call)."""
    global _armed
    _armed = True
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        value = fn(item.data_source, item.solution_str, item.ground_truth, extra_info=item.extra_info)
    except _SampleTimeout:
        return ("timeout", f"timed out after {timeout_s:g} s")
    except MemoryError as exc:
        return ("memory", memory_message(memory_limit_mb, exc))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from a function are its errors, not the worker's
        return ("error", f"raised {type(exc).__name__}: {exc}")
    finally:
        _armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    return as_score(value)


def _redirect_output(output) -> None:
    """fds 1 and 2 onto the pool's pipe, and sys.stdout / sys.stderr line-buffered over them (a line printed just
    before a crash still reaches the pool)."""
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def _limit_memory(memory_limit_mb: int) -> None:
    if memory_limit_mb <= 0:
        return
    limit = memory_limit_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the function closed it, or the pool stopped reading
            pass


def serve(conn, output, path: str | None, name: str, timeout_s: float, memory_limit_mb: int,
          sandbox: SandboxConfig | None = None) -> None:
    """A worker's main loop: load the function, then answer RewardInput jobs until None or the pipe closes."""
    _redirect_output(output)
    _limit_memory(memory_limit_mb)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        fn = load_reward_fn(path, name, sandbox)
    except BaseException as exc:
        _flush()
        memory = exc if isinstance(exc, MemoryError) else exc.__cause__  # plugin.py wraps import errors
        conn.send(("failed", "memory", f"{memory_message(memory_limit_mb, memory)} while importing the function")
                  if isinstance(memory, MemoryError) else
                  ("failed", "error", f"could not load the function: {type(exc).__name__}: {exc}"))
        return
    _flush()
    conn.send(("ready", ""))

    def answer(item):
        try:
            outcome = score_one(fn, item, timeout_s, memory_limit_mb)
        except _SampleTimeout:  # the alarm landed between the function's return and the timer's reset
            outcome = ("timeout", f"timed out after {timeout_s:g} s")
        _flush()
        return outcome

    answer_jobs(conn, answer)
