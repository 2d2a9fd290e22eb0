"""Worker processes that answer jobs over a pipe, each job under a deadline: the part written once for the two pools
that run user code, rltrain/rewards/pool.py (reward functions) and rltrain/tools/pool.py (tool calls).

    class MyPool(ProcessPool):                        # the parent's side
        def _new_worker(self):
            return PipeWorker(self._ctx, my_serve, (settings,), "my-worker", start_timeout_s=60)

    def my_serve(conn, settings):                     # the worker's side (a module-level function)
        handle = load(settings)                       # then ("ready", "") or ("failed", ...) on conn
        conn.send(("ready", ""))
        answer_jobs(conn, handle)                     # conn.send(handle(job)) per job, until None or EOF

The parent owns one duplex pipe per worker and waits on the pipes and the processes' sentinels together, so a worker
that answers, dies (os._exit, a segfault, the out-of-memory killer) or passes its deadline is noticed at once, and
only that worker is killed and replaced. What a pool does with an answer, a death or a timeout (its messages, its
counts) stays in the pool. Workers come from a forkserver (spawn where there is none): safe inside Ray actors and
threaded parents, and a replacement starts in milliseconds instead of re-importing the interpreter.
"""

from __future__ import annotations

import abc
import multiprocessing as mp
import time
from multiprocessing.connection import wait

JOIN_S = 1.0   # close(): how long a worker told to stop gets to exit before it is killed


def worker_context(preload: str):
    """The forkserver context (spawn where there is none), the server importing `preload` once for every worker."""
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:  # process-wide, and only heeded if the server is not running yet
        ctx.set_forkserver_preload([preload])
    return ctx


def answer_jobs(conn, handle) -> None:
    """A worker's loop once loaded: send `handle(job)` for every job received, until None or the pipe closes."""
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        conn.send(handle(job))


class PipeWorker:
    """One worker process, `target(child_conn, *args)`, and the parent's end of its pipe. `state`: starting (until
    its first message) | idle | busy; `job`: what it runs (the pool's key); `deadline`: monotonic time by which it
    must answer."""

    def __init__(self, ctx, target, args: tuple, name: str, start_timeout_s: float, job: int = -1):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn, *args), daemon=True, name=name)
        self.process.start()
        child_conn.close()
        self.state, self.job, self.deadline = "starting", job, time.monotonic() + start_timeout_s

    def waitables(self) -> list:
        """What wakes the parent for this worker: its pipe and its process's sentinel."""
        return [self.conn, self.process.sentinel]

    def poll(self, now: float) -> tuple[object, bool]:
        """(its message or None, whether it is done): done when it answered, died or is past its deadline."""
        message = None
        if self.conn.poll():
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
        return message, message is not None or not self.process.is_alive() or now >= self.deadline

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ProcessPool(abc.ABC):
    """The parent's side: up to `num_workers` PipeWorkers from `_new_worker`, waited on together, replaced one at a
    time. Subclasses drive them (send jobs, read answers); `close()` (or the context manager) ends them."""

    STOP_STATES = ("idle",)   # close() sends None to workers in these states and gives them JOIN_S to exit

    def __init__(self, num_workers: int, preload: str):
        self.num_workers = num_workers
        self._ctx = worker_context(preload)
        self._workers: list[PipeWorker] = []

    @abc.abstractmethod
    def _new_worker(self) -> PipeWorker:
        """A started worker of this pool's kind."""

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())

    def _replace(self, index: int, worker: PipeWorker) -> PipeWorker:
        worker.kill()
        self._workers[index] = self._new_worker()
        return self._workers[index]

    def _wait(self, extra: tuple = ()) -> None:
        """Until a worker that is not idle sends, dies or reaches its deadline (or wakes it another way), or one of
        `extra` (waitables of the caller's) is ready."""
        active = [w for w in self._workers if w.state != "idle"]
        if not active:
            return
        timeout = max(0.0, min(w.deadline for w in active) - time.monotonic())
        wait([handle for w in active for handle in w.waitables()] + list(extra), timeout=timeout)

    def close(self) -> None:
        for worker in self._workers:
            if worker.state in self.STOP_STATES:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        for worker in self._workers:
            worker.process.join(timeout=JOIN_S if worker.state in self.STOP_STATES else 0)
            worker.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
