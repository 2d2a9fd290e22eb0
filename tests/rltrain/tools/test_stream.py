"""ToolStream (rltrain/tools/stream.py): calls submitted while others run start at once, finish in their own time,
and keep the pool's limits; a call that crashes, hangs or is invalid is answered as by call_many. Order of events,
not wall-clock bounds."""

import textwrap
import time

import pytest

from rltrain.tools import ToolCall, ToolPool
from rltrain.tools.stream import ToolStream
from tests.rltrain.tools.test_pool import TOOLS


@pytest.fixture()
def stream(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    with ToolPool([{"path": str(path), "name": name} for name in ("nap", "die")], timeout_s=1.5,
                  num_workers=2) as pool:
        stream = ToolStream(pool)
        yield stream
        stream.close()


def test_a_call_submitted_later_overtakes_a_slow_one(stream):
    slow = stream.submit(ToolCall("nap", {"seconds": 1.0}))
    time.sleep(0.1)   # the slow call is running when the fast one arrives
    fast = stream.submit(ToolCall("nap", {"seconds": 0.0}))
    assert fast.result(timeout=30).ok and not slow.done()   # answered while the slow call still runs
    assert slow.result(timeout=30).content == '{"slept": 1.0}'


def test_the_pool_limit_holds_and_failures_are_answered(stream):
    # two workers: the third nap starts when one of the first two ends, so it ends last
    finished = []
    naps = [stream.submit(ToolCall("nap", {"seconds": 0.5})) for _ in range(3)]
    for i, future in enumerate(naps):
        future.add_done_callback(lambda _, i=i: finished.append(i))
    assert all(f.result(timeout=60).ok for f in naps)
    assert finished[-1] == 2, finished
    invalid, died, hung = (stream.submit(ToolCall(name, arguments)) for name, arguments in
                           (("nope", {}), ("die", {}), ("nap", {"seconds": 30.0})))
    results = [f.result(timeout=60) for f in (invalid, died, hung)]
    assert [r.status for r in results] == ["invalid", "error", "timeout"] and results[1].worker_died
