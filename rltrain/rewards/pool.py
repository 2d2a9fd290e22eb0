"""Run a reward function over a batch in worker processes, with a per-sample timeout, a memory limit and its printed
output captured.

    with RewardPool("my_reward.py", "compute_score", timeout_s=10, num_workers=2) as pool:
        result = pool.score(items)       # RewardResult: scores in order, error counts by kind, output dropped

A sample whose function raises, runs past `timeout_s`, returns something that is not a finite number (or a dict
without one under "score"), runs out of memory (`memory_limit_mb`) or kills its worker process (os._exit, a
segfault, the kernel's out-of-memory killer) scores 0.0 and is counted in `RewardResult.errors` and, by kind, in
`error_kinds` (error, timeout, memory, worker_died); the first few distinct failures of each kind are logged with the
sample's printed output. The batch goes on.

The pool owns one pipe per worker (rltrain/rewards/process.py runs the other end; rltrain/process_pool.py the pipes,
waits and replacements, shared with the tool pool) and waits on the pipes and the processes' sentinels together, so a
dead worker is noticed at once: its sample is scored, the worker replaced, the rest of the batch keeps running. (Not
multiprocessing.Pool: it replaces a dead worker silently and never delivers the sample's result, so a batch waits out
a whole deadline, 82 s for 16 samples at 2 workers and 10 s.) Timeouts: the worker arms a timer (SIGALRM) around
every call, so a Python-level hang is interrupted after exactly `timeout_s`; a hang that never returns to the
interpreter (a C extension spinning) gets its worker SIGKILLed `KILL_GRACE_S` later and only that worker replaced.
Output: a worker's stdout and stderr (Python's and C code's) come through a pipe of their own; each sample's first
`max_output_bytes` are kept, a batch shows at most that many on this process's stdout, and the rest is counted in
`RewardResult.output_dropped_bytes`. Workers come from a forkserver (spawn where there is none): safe inside Ray
actors and threaded parents, and a replacement starts without re-importing the interpreter. One thread drives a pool.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from rltrain.process_pool import PipeWorker, ProcessPool
from rltrain.rewards.plugin import bound_sandbox, load_reward_fn
from rltrain.rewards.process import serve
from rltrain.sandbox import SandboxConfig, SandboxUnavailable

logger = logging.getLogger(__name__)
KILL_GRACE_S = 2.0       # past timeout_s the timer has failed (a C-level hang): the worker is killed
START_TIMEOUT_S = 60.0   # a worker importing the function (torch-heavy plug-ins) on a loaded node
LOGGED_PER_KIND = 5      # distinct failure messages logged per kind: each can quote its sample, so all would flood
READ_BYTES = 1 << 20     # one read of a worker's output pipe
LOADING = -1             # the capture key of what workers print while importing the function


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
    errors: int = 0                          # samples that failed in any way (error_kinds says how)
    error_kinds: dict[str, int] = field(default_factory=dict)   # error | timeout | memory | worker_died -> samples
    examples: dict[str, str] = field(default_factory=dict)      # kind -> the batch's first failure message of it
    output_dropped_bytes: int = 0            # printed by the function, shown neither on stdout nor in a warning


def check_reward_settings(path: str | None, name: str, timeout_s: float, num_workers: int,
                          max_output_bytes: int = 4096, memory_limit_mb: int = 8192,
                          sandbox: SandboxConfig | None = None) -> None:
    """The reward settings' checks, written once: the config's reward section runs them before Ray starts (importing
    the plugin, so a bad file or name fails there), the pool when it is built. Errors start with the key to fix
    (`reward.timeout_s: ...`; the plugin's: `reward.path: ...`, `reward.name: ...`). A function that runs programs
    in the sandbox is refused where no sandbox backend works (probed here, once per process), so it never runs them
    without isolation; `default` is not: it needs the sandbox only for rows of code data sources, which then fail
    (reward/errors) with the reason."""
    if timeout_s <= 0:
        raise ValueError(f"reward.timeout_s: must be > 0 (got {timeout_s!r})")
    if num_workers < 1:
        raise ValueError(f"reward.num_workers: must be >= 1 (got {num_workers!r})")
    if max_output_bytes < 0:
        raise ValueError(f"reward.max_output_bytes: must be >= 0 (got {max_output_bytes!r})")
    if memory_limit_mb != 0 and memory_limit_mb < 64:  # below it the interpreter itself cannot start
        raise ValueError(f"reward.memory_limit_mb: must be 0 (no limit) or >= 64 (got {memory_limit_mb!r})")
    fn = load_reward_fn(path, name, sandbox)
    bound = bound_sandbox(fn)
    if bound is not None and (path or name != "default"):
        try:
            bound.backend   # the probe, logged
        except SandboxUnavailable as exc:
            raise ValueError(f"reward.name: {name!r} runs the model's programs in a sandbox (reward.sandbox), and "
                             f"{exc}") from None


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
    return f"killed by {name}" + (", as the kernel's out-of-memory killer does" if name == "SIGKILL" else "")


class _Worker(PipeWorker):
    """A PipeWorker with a second pipe: what the worker prints."""

    def __init__(self, ctx, args):
        self.output, child_output = ctx.Pipe(duplex=False)   # raw bytes: the worker's fds 1 and 2
        super().__init__(ctx, serve, (child_output, *args), "rltrain-reward-worker", START_TIMEOUT_S, job=LOADING)
        child_output.close()
        os.set_blocking(self.output.fileno(), False)
        self.output_open = True

    def waitables(self) -> list:
        return super().waitables() + ([self.output] if self.output_open else [])

    def read_output(self) -> bytes:
        """What the worker has printed since the last read."""
        chunks = []
        while self.output_open:
            try:
                chunk = os.read(self.output.fileno(), READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:  # every writer closed: the worker (and any child it started) is gone
                self.output_open = False
            chunks.append(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        super().kill()
        self.output.close()


class _Capture:
    """A batch's printed output: per sample (and LOADING) the bytes printed and the first `cap` of them."""

    def __init__(self, cap: int):
        self.cap = cap
        self.kept: dict[int, bytearray] = {}
        self.printed: dict[int, int] = {}
        self.in_warning: set[int] = set()   # samples whose output a failure warning showed

    def add(self, key: int, data: bytes) -> None:
        if data:
            self.printed[key] = self.printed.get(key, 0) + len(data)
            kept = self.kept.setdefault(key, bytearray())
            kept += data[:max(0, self.cap - len(kept))]

    def text(self, key: int, limit: int) -> str:
        data = bytes(self.kept.get(key, b"")[:limit])
        text = data.decode("utf-8", errors="replace").rstrip("\n")
        more = self.printed.get(key, 0) - len(data)
        return text + (f"\n[... {more} more bytes not shown]" if more else "")


class RewardPool(ProcessPool):
    """`RewardPool(path, name, timeout_s=10, num_workers=2).score(items) -> RewardResult`. Close it when done
    (or use it as a context manager)."""

    def __init__(self, path: str | None, name: str, timeout_s: float = 10.0, num_workers: int = 2,
                 max_output_bytes: int = 4096, memory_limit_mb: int = 8192, sandbox: SandboxConfig | None = None):
        check_reward_settings(path, name, timeout_s, num_workers, max_output_bytes, memory_limit_mb,
                              sandbox)  # fail here
        super().__init__(num_workers, preload="rltrain.rewards.process")
        self.path, self.name, self.timeout_s, self.sandbox = path, name, timeout_s, sandbox
        self.max_output_bytes, self.memory_limit_mb = max_output_bytes, memory_limit_mb
        self._logged: dict[str, set[str]] = {}   # kind -> the failure messages logged
        self._told_dropped = False
        self._start_failure: tuple[str, str] | None = None   # (kind, message) of this batch's last failed start

    # -- the batch ----------------------------------------------------------------------------------------------

    def score(self, items: list[RewardInput]) -> RewardResult:
        """Score every item, in order. Never raises for what the function does, nor when no worker can start (the
        samples then fail with the reason)."""
        result = RewardResult(scores=[0.0] * len(items), metrics=[{} for _ in items])
        capture, queue = _Capture(self.max_output_bytes), deque(range(len(items)))
        self._start_failure = None
        if queue:
            self._fill()
        # a replacement still starting when the queue is empty is not waited for: the next batch takes it
        while queue or any(w.state == "busy" for w in self._workers):
            if not self._workers:  # none could start: the rest of the batch fails with the reason
                while queue:
                    i = queue.popleft()
                    self._record(result, items, i, *self._start_failure, capture)
                break
            self._dispatch(items, queue, result, capture)
            self._wait()
            self._collect(items, result, capture)
        self._show(items, result, capture)
        return result

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, (self.path, self.name, self.timeout_s, self.memory_limit_mb, self.sandbox))

    def _dispatch(self, items, queue: deque, result: RewardResult, capture: _Capture) -> None:
        for index, worker in enumerate(self._workers):
            while worker.state == "idle" and queue:
                i = queue.popleft()
                if not worker.process.is_alive():  # died while idle, not by this sample: a new one takes it
                    queue.appendleft(i)
                    worker = self._replace(index, worker)
                    break
                try:
                    worker.conn.send(items[i])
                except OSError:
                    queue.appendleft(i)
                    worker = self._replace(index, worker)
                    break
                except Exception as exc:  # the sample does not pickle
                    self._record(result, items, i, "error", f"could not be sent to a worker: {type(exc).__name__}: "
                                                            f"{exc}", capture)
                    continue
                worker.state, worker.job = "busy", i
                worker.deadline = time.monotonic() + self.timeout_s + KILL_GRACE_S

    def _collect(self, items, result: RewardResult, capture: _Capture) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.state == "idle":
                continue
            capture.add(worker.job, worker.read_output())
            message, done = worker.poll(now)
            if not done:
                continue
            capture.add(worker.job, worker.read_output())  # all it printed before answering or dying
            if worker.state == "starting":
                self._started(worker, message)
                continue
            i = worker.job
            if message is not None:
                worker.state = "idle"
                if message[0] == "ok":
                    result.scores[i], result.metrics[i] = message[1], message[2]
                else:
                    self._record(result, items, i, message[0], message[1], capture)
                if message[0] == "memory":  # a fresh process: what leaked stays with the old one
                    self._replace(self._workers.index(worker), worker)
                continue
            if worker.process.is_alive():  # _replace kills it
                kind, text = "timeout", (f"did not return within {self.timeout_s:g} s (+{KILL_GRACE_S:g} s) and was "
                                         "killed: a hang outside Python (C code) that the timer could not interrupt")
            else:
                kind, text = "worker_died", (f"killed its worker process ({describe_exit(worker.process.exitcode)}) "
                                             "while scoring this sample")
            self._replace(self._workers.index(worker), worker)
            self._record(result, items, i, kind, text, capture)

    def _started(self, worker: _Worker, message) -> None:
        if message is not None and message[0] == "ready":
            worker.state = "idle"
            return
        if message is not None:
            kind, reason = message[1], message[2]
        elif not worker.process.is_alive():
            kind, reason = "worker_died", (f"its worker process died while importing the function "
                                           f"({describe_exit(worker.process.exitcode)})")
        else:
            kind, reason = "error", f"its worker process did not load the function within {START_TIMEOUT_S:g} s"
        worker.kill()
        self._workers.remove(worker)  # not replaced in this batch: the next one tries again
        self._start_failure = (kind, f"could not be scored: {reason}")

    # -- failures and output ------------------------------------------------------------------------------------

    def _record(self, result: RewardResult, items, index: int, kind: str, message: str, capture: _Capture) -> None:
        result.errors += 1
        result.error_kinds[kind] = result.error_kinds.get(kind, 0) + 1
        result.examples.setdefault(kind, message)
        logged = self._logged.setdefault(kind, set())
        if message in logged or len(logged) >= LOGGED_PER_KIND:
            return
        logged.add(message)
        output = ""
        if capture.printed.get(index):
            capture.in_warning.add(index)
            output = f" Its output (stdout and stderr):\n{capture.text(index, self.max_output_bytes)}"
        last = (f" That is {LOGGED_PER_KIND} distinct failures of this kind: more are counted, not logged."
                if len(logged) == LOGGED_PER_KIND else "")
        logger.warning("reward function %r %s (sample %d of the batch, data_source %r); scored 0. Further identical "
                       "failures are counted in reward/errors, not logged.%s%s", self.name, message, index,
                       items[index].data_source, last, output)

    def _show(self, items, result: RewardResult, capture: _Capture) -> None:
        """Print up to max_output_bytes of the batch's output, sample by sample; count the rest as dropped."""
        printed = sum(capture.printed.values())
        if not printed:
            return
        shown = sum(min(capture.printed[i], self.max_output_bytes) for i in capture.in_warning)
        budget, blocks = self.max_output_bytes, []   # the headers count too: 500 one-line prints stay 4 KB
        for key in sorted(capture.kept):
            if key in capture.in_warning or not capture.kept[key]:
                continue
            where = "importing the function" if key == LOADING else f"sample {key} ({items[key].data_source})"
            header = f"[reward output] {self.name}, {where}:"
            if budget <= len(header):
                break
            take = min(budget - len(header), len(capture.kept[key]))
            budget, shown = budget - len(header) - take, shown + take
            text = capture.text(key, take)
            blocks.append(f"{header}{chr(10) if chr(10) in text else ' '}{text}")   # a one-line print: one line
        if blocks:
            print("\n".join(blocks), file=sys.stdout, flush=True)
        result.output_dropped_bytes = printed - shown
        if result.output_dropped_bytes and not self._told_dropped:
            self._told_dropped = True
            logger.warning("reward function %r printed %d bytes in this batch, %d of them not shown: a batch shows "
                           "at most reward.max_output_bytes=%d. Later batches' are counted in "
                           "reward/output_dropped_bytes, not announced.", self.name, printed,
                           result.output_dropped_bytes, self.max_output_bytes)
