"""ToolStream: tool calls submitted from any thread (rollout.mode=async: each episode's asyncio task) run on one
ToolPool as they arrive, each answered as soon as it finishes, so an episode waits for its own tools only.

    stream = ToolStream(pool)
    results = await asyncio.gather(*(asyncio.wrap_future(stream.submit(call)) for call in calls))

One driver thread owns the pool (it is not re-entrant) and runs `ToolPool.serve`: the pool's limits hold as in
call_many (at most num_workers calls at a time, each with its timeout), and a call submitted while others run is
picked up at once (a pipe wakes the driver's wait) instead of after them.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from multiprocessing import Pipe

from rltrain.tools.base import ToolCall, ToolResult
from rltrain.tools.pool import ToolPool


class ToolStream:
    def __init__(self, pool: ToolPool):
        self.pool = pool
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # (Future, ToolCall), or None to stop
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._lock = threading.Lock()   # one writer on the pipe at a time
        self._thread = threading.Thread(target=self._drive, name="rltrain-tool-stream", daemon=True)
        self._thread.start()

    def submit(self, call: ToolCall) -> Future:
        """The call's ToolResult, when its turn on the pool comes and it finishes."""
        future: Future = Future()
        self._inbox.put((future, call))
        with self._lock:
            self._wake_writer.send_bytes(b"")
        return future

    def close(self) -> None:
        """Stop the driver (after the calls already submitted); the pool stays open (its owner closes it)."""
        if self._thread.is_alive():
            self._inbox.put(None)
            with self._lock:
                self._wake_writer.send_bytes(b"")
            self._thread.join()

    def _drive(self) -> None:
        stop, unanswered = False, set()   # the futures taken from the inbox and not yet answered

        def refill(calls: deque) -> None:
            nonlocal stop
            while self._wake_reader.poll():
                self._wake_reader.recv_bytes()
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if item is None:
                    stop = True
                else:
                    calls.append(item)
                    unanswered.add(item[0])

        def deliver(future: Future, result: ToolResult) -> None:
            unanswered.discard(future)
            future.set_result(result)

        while not stop:
            first = self._inbox.get()   # idle: block until a call (or the stop) arrives
            if first is None:
                return
            unanswered.add(first[0])
            try:
                self.pool.serve(deque([first]), deliver, refill, self._wake_reader)
            except BaseException as err:   # a worker that could not start: every call taken fails with it
                refill(deque())
                for future in unanswered:
                    future.set_exception(err)
                unanswered.clear()
