"""ToolPool: results in order, captured exceptions, output cap, timeouts that kill only the stuck worker, a worker
dying mid-call (os._exit), malformed and unknown calls answered without running, concurrency, and the counters."""

import logging
import textwrap
import time

import pytest

from rltrain.tools import ToolCall, ToolPool
from rltrain.tools.pool import LOGGED_PER_KIND

TOOLS = '''
import os, time
from rltrain.tools import tool

OBJECT = {"type": "object", "properties": {"seconds": {"type": "number"}, "n": {"type": "integer"}}}

@tool("Sleep, then return how long.", OBJECT)
def nap(seconds=0.0, n=0):
    time.sleep(seconds)
    return {"slept": seconds}

@tool("Always fails.", OBJECT)
def boom(seconds=0.0, n=0):
    raise KeyError("no such row")

@tool("Kills its own process.", OBJECT)
def die(seconds=0.0, n=0):
    os._exit(7)

@tool("Returns n characters.", OBJECT)
def flood(seconds=0.0, n=0):
    return "z" * n

@tool("Sleeps through every signal it can catch.", OBJECT)
def stubborn(seconds=0.0, n=0):
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass

@tool("Returns something that is not JSON.", OBJECT)
def opaque(seconds=0.0, n=0):
    return object()
'''
NAMES = ["nap", "boom", "die", "flood", "stubborn", "opaque"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    entries = [{"path": str(path), "name": name} for name in NAMES] + [{"builtin": "calculator"}]
    with ToolPool(entries, timeout_s=2.0, num_workers=4, max_output_chars=100) as pool:
        assert pool.call_many([ToolCall("nap")])[0].ok  # workers started before the timed tests
        pool.pop_metrics()
        yield pool


def test_results_in_order_with_errors_captured(pool):
    results = pool.call_many([ToolCall("calculator", {"expression": "6*7"}, id="c0"), ToolCall("boom", id="c1"),
                              ToolCall("calculator", {"expression": "1/0"}), ToolCall("opaque"),
                              ToolCall("nap", {"seconds": 0})])
    assert [r.status for r in results] == ["ok", "error", "error", "error", "ok"]
    assert results[0].content == "42" and results[0].call_id == "c0"
    assert results[1].content == "Error: KeyError: 'no such row'" and results[1].call_id == "c1"
    assert results[2].content == "Error: CalculatorError: division by zero"
    assert "neither text nor JSON-serializable" in results[3].content
    assert results[4].content == '{"slept": 0}'
    assert pool.pop_metrics(episodes=2) == pytest.approx({
        "tool/calls": 5, "tool/errors": 3, "tool/timeouts": 0, "tool/invalid_calls": 0, "tool/worker_deaths": 0,
        "tool/calls_per_episode": 2.5, "tool/mean_seconds": pytest.approx(0.0, abs=1.0)})


def test_invalid_calls_are_answered_without_running(pool):
    results = pool.call_many([ToolCall("", error="the tool call is not valid JSON"), ToolCall("search", {}),
                              ToolCall("calculator", {}), ToolCall("calculator", {"expression": 3}),
                              ToolCall("calculator", {"expression": "1", "mode": "exact"})])
    assert [r.status for r in results] == ["invalid"] * 5
    contents = [r.content for r in results]
    assert contents[0] == "Error: the tool call is not valid JSON"
    assert "no tool named 'search'; tools: nap, boom, die, flood, stubborn, opaque, calculator" in contents[1]
    assert "missing required argument(s): expression" in contents[2]
    assert "must be of type string, got 3" in contents[3]
    assert "unknown argument(s) 'mode'" in contents[4]
    assert pool.pop_metrics()["tool/invalid_calls"] == 5


def test_output_is_capped_with_a_marker(pool):
    (result,) = pool.call_many([ToolCall("flood", {"n": 1000})])
    assert result.ok and result.content == "z" * 100 + "\n[output truncated: 900 more characters]"
    (short,) = pool.call_many([ToolCall("flood", {"n": 100})])
    assert short.content == "z" * 100


def test_calls_run_concurrently(pool):
    start = time.monotonic()
    results = pool.call_many([ToolCall("nap", {"seconds": 1.0}) for _ in range(4)])
    elapsed = time.monotonic() - start
    assert all(r.ok for r in results)
    assert elapsed < 2.5, f"4 one-second calls on 4 workers took {elapsed:.1f} s: they ran one after another"
    start = time.monotonic()  # 8 calls on 4 workers: two waves
    pool.call_many([ToolCall("nap", {"seconds": 0.5}) for _ in range(8)])
    assert 0.9 < time.monotonic() - start < 3.0


def test_hang_and_crash_cost_one_call_not_the_batch(pool):
    pool.pop_metrics()
    start = time.monotonic()
    results = pool.call_many([ToolCall("stubborn"), ToolCall("die"), ToolCall("nap", {"seconds": 0.2}),
                              ToolCall("calculator", {"expression": "2**5"}), ToolCall("nap", {"seconds": 0.2})])
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["timeout", "error", "ok", "ok", "ok"]
    assert results[0].content == "Error: the tool did not finish within 2 s and was stopped"
    assert "worker process died (exit code 7)" in results[1].content
    assert [r.worker_died for r in results] == [False, True, False, False, False]
    assert results[3].content == "32"
    assert 1.9 < elapsed < 6.0
    metrics = pool.pop_metrics(episodes=5)
    assert (metrics["tool/timeouts"], metrics["tool/errors"], metrics["tool/calls_per_episode"]) == (1, 1, 1.0)
    assert metrics["tool/worker_deaths"] == 1   # the error was its worker dying: noticed at once, not a timeout
    again = pool.call_many([ToolCall("nap") for _ in range(4)])  # all four workers answer again
    assert all(r.ok for r in again)


def test_bad_settings_and_tools_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="timeout_s > 0"):
        ToolPool([{"builtin": "calculator"}], timeout_s=0)
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tools\[0\].builtin: unknown built-in tool 'calc'"):
        ToolPool([{"builtin": "calc"}])


def test_failures_are_logged_a_few_times_per_tool_and_status(caplog):
    """Each malformed call's message differs (it quotes the call): a handful per tool and status reach the log, the
    rest only the counts."""
    with ToolPool([{"builtin": "calculator"}], num_workers=1) as pool, caplog.at_level(logging.WARNING):
        pool.call_many([ToolCall("calculator", {"expression": i}) for i in range(20)])    # invalid, 20 messages
        pool.call_many([ToolCall("", error=f"the tool call is not valid JSON (#{i})") for i in range(3)])
        assert pool.pop_metrics()["tool/invalid_calls"] == 23
    warnings = [r.getMessage() for r in caplog.records if r.name == "rltrain.tools.pool"]
    assert len(warnings) == LOGGED_PER_KIND + 3, warnings
    assert sum("more are counted in tool/*" in w for w in warnings) == 1
