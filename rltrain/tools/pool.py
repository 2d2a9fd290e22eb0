"""ToolPool: runs tool calls in worker processes, concurrently, each with a timeout, an output cap and its exceptions
captured, so a tool that hangs, crashes or floods never stalls or kills the rollout step.

    with ToolPool([{"builtin": "calculator"}], timeout_s=10, num_workers=4) as pool:
        results = pool.call_many(calls)        # one ToolResult per ToolCall, same order
        metrics = pool.pop_metrics(episodes=len(batch))   # tool/calls, tool/errors, tool/timeouts, ...

The turn-synchronous multi-turn loop gathers every episode's calls of one turn into one `call_many`, so episodes wait
for their tools together; rollout.mode=async feeds calls as they come through `serve` (rltrain/tools/stream.py). Calls
go to idle workers as they free up (at most `num_workers` at a time) and each call's clock starts when its worker
takes it. The parent owns one pipe per worker (rltrain/process_pool.py, shared with the reward pool): a call past
`timeout_s` gets its worker SIGKILLed (whatever it is stuck in: a sleep, a C loop, a child it waits on; no timer
inside the worker, unlike rewards) and only that worker is replaced, while the others keep running; a worker that dies
(os._exit, a segfault) is noticed at once through its process sentinel. Workers come from a forkserver (spawn where
there is none): safe inside Ray actors and threaded parents, and a replacement starts in milliseconds instead of
re-importing the interpreter. One thread drives a pool: call_many and serve are not re-entrant.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence

from rltrain.process_pool import PipeWorker, ProcessPool, answer_jobs
from rltrain.tools.base import ToolCall, ToolResult, check_arguments
from rltrain.tools.loader import TOOLS_KEY, ToolSpec, load_tools

logger = logging.getLogger(__name__)
# distinct failure messages logged per (tool, status): a model's malformed calls all differ (each message quotes the
# call), so a per-message filter alone logged hundreds of lines a run; the counts are in tool/* either way
LOGGED_PER_KIND = 5
START_TIMEOUT_S = 60.0   # a worker importing the tools (torch-heavy plug-ins) on a loaded node


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[output truncated: {len(text) - max_chars} more characters]"


def _run_tool(fn, arguments: dict, max_chars: int) -> tuple[str, str]:
    """In a worker: ('ok', text) | ('error', 'ExceptionType: message')."""
    try:
        value = fn(**arguments)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from a tool are its errors, not the worker's
        return "error", truncate(f"{type(exc).__name__}: {exc}", max_chars)
    if isinstance(value, str):
        return "ok", truncate(value, max_chars)
    try:
        return "ok", truncate(json.dumps(value, ensure_ascii=False), max_chars)
    except (TypeError, ValueError):
        return "error", f"the tool returned a {type(value).__name__}, which is neither text nor JSON-serializable"


def _serve(conn, specs: list[ToolSpec], max_chars: int) -> None:
    """A worker's main loop: load the tools, then answer (name, arguments) jobs until None or the pipe closes."""
    try:
        tools = {name: loaded.fn for name, loaded in load_tools(specs).items()}
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    answer_jobs(conn, lambda job: _run_tool(tools[job[0]], job[1], max_chars))   # job: (name, arguments)


class ToolPool(ProcessPool):
    STOP_STATES = ("idle", "starting")   # a starting one reads the None after loading the tools

    def __init__(self, tools: Sequence[ToolSpec | Mapping], timeout_s: float = 10.0, num_workers: int = 4,
                 max_output_chars: int = 4000):
        if timeout_s <= 0 or num_workers < 1 or max_output_chars < 1:
            raise ValueError(f"ToolPool needs timeout_s > 0, num_workers >= 1, max_output_chars >= 1 (got "
                             f"{timeout_s!r}, {num_workers!r}, {max_output_chars!r})")
        self.specs = [ToolSpec.from_entry(entry, f"{TOOLS_KEY}[{i}]") for i, entry in enumerate(tools)]
        self.schemas = {name: loaded.schema for name, loaded in load_tools(self.specs).items()}  # fail here, early
        super().__init__(num_workers, preload="rltrain.tools.pool")
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self._logged: dict[tuple[str, str], set[str]] = {}   # (tool, status) -> the failure messages logged
        self._counts = dict.fromkeys(("calls", "errors", "timeouts", "invalid_calls", "worker_deaths", "seconds"),
                                     0.0)

    # -- the batched call ---------------------------------------------------------------------------------------

    def call_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run the calls concurrently over the workers; one ToolResult per call, in order. Never raises for what a
        tool does (only if a worker cannot start at all)."""
        results: list[ToolResult | None] = [None] * len(calls)
        self.serve(deque(enumerate(calls)), results.__setitem__)
        return results

    def serve(self, queue: deque, deliver, refill=None, wake=None) -> None:
        """Run the (key, ToolCall) pairs of `queue` over the workers, at most num_workers at a time, each result to
        deliver(key, result) as it comes; returns when the queue is empty and no call runs. refill(queue) (if given)
        may append more pairs before each dispatch, and `wake` (a waitable) interrupts the wait for them: how
        `ToolStream` (rltrain/tools/stream.py) feeds calls that arrive while others run."""
        calls, started, waiting = {}, {}, deque()   # waiting: keys of the calls no idle worker has taken yet
        while True:
            if refill is not None:
                refill(queue)
            pending = deque()
            for key, call in queue:
                problem = call.error or self._problem(call)
                if problem:
                    deliver(key, self._finish(call, "invalid", problem, 0.0))
                else:
                    pending.append(key)
                    calls[key] = call
            queue.clear()
            if pending:
                self._fill()
            waiting.extend(pending)
            if not waiting and not any(w.state == "busy" for w in self._workers):
                return
            for worker in self._workers:
                if worker.state == "idle" and waiting:
                    key = waiting.popleft()
                    try:
                        worker.conn.send((calls[key].name, calls[key].arguments))
                    except OSError:  # it died since; the next wait sees its sentinel and answers the call
                        pass
                    started[key], worker.state, worker.job = time.monotonic(), "busy", key
                    worker.deadline = started[key] + self.timeout_s
            self._wait_and_collect(calls, started, deliver, wake)

    def _wait_and_collect(self, calls, started, deliver, wake) -> None:
        self._wait(() if wake is None else (wake,))
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            if worker.state == "idle":
                continue
            message, done = worker.poll(now)
            if not done:
                continue
            if worker.state == "starting":
                self._started(index, worker, message)
                continue
            key = worker.job
            call, elapsed = calls.pop(key), now - started.pop(key)
            dead = message is None and not worker.process.is_alive()
            if message is not None:
                status, content = message
                worker.state = "idle"
            else:
                status = "error" if dead else "timeout"
                content = (f"the tool's worker process died (exit code {worker.process.exitcode}) while running it"
                           if dead else f"the tool did not finish within {self.timeout_s:g} s and was stopped")
                self._replace(index, worker)
            deliver(key, self._finish(call, status, content, elapsed, worker_died=dead))

    def _started(self, index: int, worker: PipeWorker, message) -> None:
        if message is not None and message[0] == "ready":
            worker.state = "idle"
            return
        worker.kill()
        self.close()
        reason = message[1] if message else ("it died" if not worker.process.is_alive() else
                                             f"it did not start within {START_TIMEOUT_S:g} s")
        raise RuntimeError(f"a tool worker process could not load the tools ({reason})")

    def _new_worker(self) -> PipeWorker:
        return PipeWorker(self._ctx, _serve, (self.specs, self.max_output_chars), "rltrain-tool-worker",
                          START_TIMEOUT_S)

    def _problem(self, call: ToolCall) -> str | None:
        schema = self.schemas.get(call.name)
        if schema is None:
            return f"there is no tool named {call.name!r}; tools: {', '.join(self.schemas)}"
        return check_arguments(schema, call.arguments)

    def _finish(self, call: ToolCall, status: str, content: str, elapsed: float,
                worker_died: bool = False) -> ToolResult:
        self._counts["calls"] += 1
        self._counts["seconds"] += elapsed
        self._counts["worker_deaths"] += worker_died
        if status != "ok":
            self._counts[{"error": "errors", "timeout": "timeouts", "invalid": "invalid_calls"}[status]] += 1
            content = truncate(f"Error: {content}", self.max_output_chars)
            logged = self._logged.setdefault((call.name, status), set())
            if content not in logged and len(logged) < LOGGED_PER_KIND:
                logged.add(content)
                last = len(logged) == LOGGED_PER_KIND
                logger.warning("tool call %s(%s) -> %s: %s.%s", call.name or "?", json.dumps(call.arguments)[:200],
                               status, content, f" That is {LOGGED_PER_KIND} such failures of this tool: more are "
                               "counted in tool/*, not logged." if last else "")
        return ToolResult(call.name, content, status, call.id, elapsed, worker_died)

    # -- metrics ------------------------------------------------------------------------------------------------

    def pop_metrics(self, episodes: int | None = None) -> dict[str, float]:
        """The counts since the last pop: tool/calls, tool/errors (raised or crashed), tool/timeouts,
        tool/invalid_calls (malformed or not matching a schema; the model was told why), tool/worker_deaths (errors
        that were the worker process dying), tool/mean_seconds, and tool/calls_per_episode when `episodes` is given."""
        counts, calls = self._counts, self._counts["calls"]
        metrics = {f"tool/{k}": counts[k] for k in ("calls", "errors", "timeouts", "invalid_calls", "worker_deaths")}
        metrics["tool/mean_seconds"] = counts["seconds"] / calls if calls else 0.0
        if episodes:
            metrics["tool/calls_per_episode"] = calls / episodes
        self._counts = dict.fromkeys(counts, 0.0)
        return metrics
