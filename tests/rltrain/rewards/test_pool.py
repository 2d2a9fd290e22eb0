"""RewardPool: scores in order, functions that raise, hang (in Python or past the timer), return non-numbers, kill
their worker (os._exit, SIGKILL as the out-of-memory killer sends it), run out of their memory limit or flood their
output; each costs its own sample, never the batch, and is counted by kind.

    .venv/bin/python -m pytest tests/rltrain/rewards/test_pool.py -q     # about 6 s on 2 cores
"""

import logging
import textwrap
import time

import pytest

from rltrain.rewards import RewardInput, RewardPool
from rltrain.rewards.health import RewardStats


def _plugin(tmp_path, body, name="plugin.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rltrain.rewards.pool"]


def test_pool_scores_and_survives_bad_functions(tmp_path, caplog):
    plugin = _plugin(tmp_path, """
        import time

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "raise":
                raise RuntimeError("boom")
            if solution_str == "hang":
                time.sleep(60)
            if solution_str == "string":
                return "high"
            if solution_str == "nan":
                return float("nan")
            if solution_str == "dict":
                return {"score": 0.25, "length": 3, "note": "text"}
            return float(solution_str == ground_truth)
    """)
    texts = ["7", "8", "raise", "hang", "string", "nan", "dict", "raise"]
    items = [RewardInput("src", t, "7") for t in texts]
    with caplog.at_level(logging.WARNING, logger="rltrain.rewards.pool"):
        with RewardPool(plugin, "fn", timeout_s=1.0, num_workers=2) as pool:
            result = pool.score(items)
            again = pool.score([RewardInput("src", "7", "7")])  # pool still usable
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]
    assert result.metrics[6] == {"length": 3.0}
    assert result.errors == 5
    assert result.error_kinds == {"error": 4, "timeout": 1}
    assert again.scores == [1.0] and again.errors == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("RuntimeError: boom" in m for m in messages) == 1  # logged once, counted twice
    assert any("timed out after 1 s" in m for m in messages)


def test_pool_kills_a_hang_that_ignores_the_timer(tmp_path):
    plugin = _plugin(tmp_path, """
        import time

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "stubborn":
                while True:
                    try:
                        time.sleep(10)
                    except BaseException:
                        pass
            return 1.0
    """)
    with RewardPool(plugin, "fn", timeout_s=0.5, num_workers=1) as pool:
        result = pool.score([RewardInput("s", "ok", ""), RewardInput("s", "stubborn", "")])
        assert result.scores == [1.0, 0.0] and result.error_kinds == {"timeout": 1}
        assert pool.score([RewardInput("s", "ok", "")]).scores == [1.0]  # rebuilt


def test_pool_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"reward.timeout_s: must be > 0 \(got 0\)"):
        RewardPool(None, "math", timeout_s=0)
    with pytest.raises(ValueError, match="unknown built-in reward function"):
        RewardPool(None, "nope")


def test_a_dead_worker_costs_its_sample_not_the_batch(tmp_path, caplog):
    """A worker that exits or is SIGKILLed mid-batch is noticed at once: its sample scores 0 as worker_died, the
    worker is replaced, the batch goes on. (A multiprocessing.Pool waited out its batch deadline, 2·10 + 2 s here,
    and called it a timeout.)"""
    plugin = _plugin(tmp_path, """
        import os, signal, time

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "exit":
                os._exit(3)
            if solution_str == "oom":
                print("allocating", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
            return 1.0
    """)
    texts = ["a", "exit", "b", "c", "oom", "d", "e", "f"]
    with caplog.at_level(logging.WARNING, logger="rltrain.rewards.pool"):
        with RewardPool(plugin, "fn", timeout_s=10.0, num_workers=2) as pool:
            pool.score([RewardInput("s", "warm", "")])   # workers started: the bound below is the batch's own
            start = time.monotonic()
            result = pool.score([RewardInput("src", t, "") for t in texts])
            elapsed = time.monotonic() - start
            again = pool.score([RewardInput("s", t, "") for t in "xyz"])
    assert elapsed < 5.0, f"the batch took {elapsed:.1f} s: a dead worker was waited for"
    assert result.scores == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert result.errors == 2 and result.error_kinds == {"worker_died": 2}
    assert RewardStats.of(result).metrics()["reward/worker_deaths"] == 2
    assert again.scores == [1.0] * 3 and again.errors == 0
    warnings = _warnings(caplog)
    assert any("killed its worker process (exit code 3)" in m and "sample 1 of the batch" in m for m in warnings)
    died = [m for m in warnings if "killed by SIGKILL, as the kernel's out-of-memory killer does" in m]
    assert len(died) == 1 and "Its output (stdout and stderr):\nallocating" in died[0]  # printed just before


def test_memory_limit_is_set_and_a_breach_costs_one_sample(tmp_path, caplog):
    plugin = _plugin(tmp_path, """
        import resource

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "limit":
                return resource.getrlimit(resource.RLIMIT_DATA)[0] / 2**20
            if solution_str == "hog":
                hog = bytearray(400 * 2**20)
            return 1.0
    """)
    items = [RewardInput("s", t, "") for t in ("limit", "hog", "ok", "hog")]
    with caplog.at_level(logging.WARNING, logger="rltrain.rewards.pool"):
        with RewardPool(plugin, "fn", timeout_s=5.0, num_workers=1, memory_limit_mb=200) as pool:
            result = pool.score(items)
    assert result.scores == [200.0, 0.0, 1.0, 0.0]
    assert result.error_kinds == {"memory": 2}
    assert RewardStats.of(result).metrics()["reward/memory_errors"] == 2
    assert "ran out of memory (MemoryError) under reward.memory_limit_mb=200" in result.examples["memory"]
    with pytest.raises(ValueError, match=r"reward.memory_limit_mb: must be 0 \(no limit\) or >= 64 \(got 10\)"):
        RewardPool(plugin, "fn", memory_limit_mb=10)


def test_a_function_that_cannot_load_in_its_worker_fails_its_samples(tmp_path):
    """Importing the plug-in past the memory limit: every sample fails with the reason, score() does not raise."""
    plugin = _plugin(tmp_path, """
        BIG = bytearray(150 * 2**20)

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    with RewardPool(plugin, "fn", timeout_s=5.0, num_workers=2, memory_limit_mb=100) as pool:
        result = pool.score([RewardInput("s", "x", "") for _ in range(3)])
    assert result.scores == [0.0] * 3 and result.error_kinds == {"memory": 3}
    assert result.examples["memory"].startswith("could not be scored: ran out of memory")
    assert result.examples["memory"].endswith("while importing the function")


def test_output_is_captured_and_capped(tmp_path, capsys, caplog):
    """Python prints and C-level writes alike: a batch shows at most max_output_bytes, a failure's warning shows its
    sample's own output, the rest is counted and announced once."""
    plugin = _plugin(tmp_path, """
        import os, sys
        print("loading the verifier")

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "flood":
                print("x" * 1_000_000)
                os.write(1, b"c-level " * 100_000)
                print("err" * 1000, file=sys.stderr)
            if solution_str == "raise":
                print("about to fail on", solution_str)
                raise ValueError("bad answer")
            return 1.0
    """)
    items = [RewardInput("s", t, "") for t in ("flood", "raise", "flood")]
    with caplog.at_level(logging.WARNING, logger="rltrain.rewards.pool"):
        with RewardPool(plugin, "fn", timeout_s=5.0, num_workers=1, max_output_bytes=1000) as pool:
            capsys.readouterr()   # the import that checks the plug-in, in this process
            result = pool.score(items)
            shown = capsys.readouterr().out
            second = pool.score(items[:1])
            shown_second = capsys.readouterr().out
    assert result.scores == [1.0, 0.0, 1.0] and result.error_kinds == {"error": 1}
    loading, failing = "loading the verifier\n", "about to fail on raise\n"
    flood = 1_000_001 + 800_000 + 3001
    headers = ["[reward output] fn, importing the function:", "[reward output] fn, sample 0 (s):"]
    assert shown.startswith(f"{headers[0]} {loading}{headers[1]}\nxxx")
    assert len(shown) < 1100 and shown.rstrip().endswith("more bytes not shown]")  # 1000 + the marker line
    assert "sample 2" not in shown   # the batch's 1000 bytes were used up
    warning = [m for m in _warnings(caplog) if "raised ValueError: bad answer" in m]
    assert len(warning) == 1 and warning[0].endswith(f"Its output (stdout and stderr):\n{failing.strip()}")
    shown_bytes = 1000 - sum(map(len, headers))   # the output under the headers, the loading line included
    assert result.output_dropped_bytes == len(loading) + 2 * flood - shown_bytes   # the failure's: in its warning
    assert second.output_dropped_bytes == flood - (1000 - len(headers[1])) and len(shown_second) < 1100
    announced = [m for m in _warnings(caplog) if "reward.max_output_bytes=1000" in m]
    assert len(announced) == 1   # once, not per batch
    assert RewardStats.of(second).metrics()["reward/output_dropped_bytes"] == second.output_dropped_bytes
