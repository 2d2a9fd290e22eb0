"""The built-in `code` reward: the program taken from the response, the tests from the row (input/output pairs,
assert lines, verl's ground_truth), all-or-nothing scores for right, wrong, crashing and timed-out programs, the
early-exit hack failing, and through the RewardPool: reward.sandbox's limits, failures counted as reward errors, a
machine without isolation refusing `code` up front while `default` scores its math rows. About 8 s on 2 cores.

    PYTHONPATH=$PWD:$PWD/kernels .venv/bin/python -m pytest -q tests/rltrain/rewards/test_code.py
"""

import json

import pytest

from rltrain.rewards import RewardInput, RewardPool
from rltrain.rewards.builtin import BUILTIN_REWARDS, DATA_SOURCE_REWARDS
from rltrain.rewards.code import code_reward, extract_program, load_tests, same_output
from rltrain.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, probe
from tests.helpers import sandbox_unavailable

NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"needs a sandbox: {NO_SANDBOX}")
ADD = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42"}]}
RIGHT = "Reading two numbers:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"


def test_the_program_is_the_last_python_block():
    assert extract_program("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```\nplain\n```") == "print(2)\n"
    assert extract_program("```bash\nls\n```\n```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"


def test_tests_come_from_extra_info_or_verls_ground_truth():
    pairs = [{"input": "1", "output": "2"}]
    assert load_tests(None, {"tests": pairs}) == pairs
    assert load_tests(None, {"tests": ["assert f(1) == 2"]}) == ["assert f(1) == 2"]
    verl = {"inputs": ["1\n", "2\n"], "outputs": ["2\n", "4\n"]}
    expected = [{"input": "1\n", "output": "2\n"}, {"input": "2\n", "output": "4\n"}]
    assert load_tests(json.dumps(verl), {"index": 3}) == expected and load_tests(verl, None) == expected
    for ground_truth, extra_info, message in [
            ("42", None, "must be a non-empty list"), ("not json", None, "is not the JSON of"),
            ({"inputs": ["1"], "outputs": []}, None, "two lists of one length"),
            ({"fn_name": "f", "inputs": [], "outputs": []}, None, "call-based tests"),
            (None, {"tests": [{"input": "1"}]}, "all be {\"input\", \"output\"} pairs or all assert lines")]:
        with pytest.raises(ValueError, match=message):
            load_tests(ground_truth, extra_info)


def test_outputs_compare_stripped_line_by_line():
    assert same_output("3  \n4\n\n", "3\n4") and not same_output("3 4", "3\n4") and not same_output("", "0")


def test_code_data_sources_pick_the_code_reward():
    assert all(DATA_SOURCE_REWARDS[s] == "code" for s in ("code", "apps", "taco", "codecontests", "codeforces"))
    assert BUILTIN_REWARDS.get("code") is code_reward


@needs_sandbox
def test_scores_are_all_or_nothing():
    sandbox = Sandbox(SandboxConfig(wall_s=1))
    score = lambda response, info=ADD: code_reward("code", response, None, info, sandbox=sandbox)  # noqa: E731
    assert score(RIGHT) == {"score": 1.0, "tests": 2.0, "timed_out": 0.0}
    assert score("```python\nprint(3)\n```") == {"score": 0.0, "tests": 2.0, "timed_out": 0.0}   # 1 of 2: nothing
    assert score("```python\nprint(1 / 0)\n```")["score"] == 0.0
    assert score("```python\nwhile True:\n    pass\n```") == {"score": 0.0, "tests": 1.0, "timed_out": 1.0}
    asserts = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
    assert score("```python\ndef add(a, b):\n    return a + b\n```", asserts)["score"] == 1.0
    assert score("```python\nprint('no newline', end='')\nadd = lambda a, b: a + b\n```", asserts)["score"] == 1.0
    assert score("```python\ndef add(a, b):\n    return a - b\n```", asserts)["score"] == 0.0
    for hack in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        assert score(f"```python\n{hack}\n```", asserts)["score"] == 0.0, hack


@needs_sandbox
def test_pool_scores_code_rows_and_counts_failures_as_errors():
    """Through the worker processes with reward.sandbox's wall clock: a timeout is a wrong answer (score 0, logged as
    reward/timed_out), a row without tests is the data's error (reward/errors)."""
    items = [RewardInput("code", RIGHT, None, ADD),
             RewardInput("apps", "```python\nprint(0)\n```", json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})),
             RewardInput("code", "```python\nimport time\ntime.sleep(9)\n```", None, ADD),
             RewardInput("code", RIGHT, None, {"index": 0}),
             RewardInput("openai/gsm8k", "#### 7", "7")]
    with RewardPool(None, "default", timeout_s=20, num_workers=2, sandbox=SandboxConfig(wall_s=1)) as pool:
        result = pool.score(items)
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.errors == 1 and result.error_kinds == {"error": 1}
    assert "the row's tests must be a non-empty list" in result.examples["error"]
    assert [m.get("timed_out") for m in result.metrics] == [0.0, 0.0, 1.0, None, None]


def _bwrap_works() -> bool:
    try:
        return probe("bwrap") == "bwrap"
    except SandboxUnavailable:
        return False


@pytest.fixture
def without_bwrap(monkeypatch):
    """backend=bwrap where bubblewrap does not work: a real failing probe, in this process and in the workers (their
    forkserver may have started with an earlier PATH: hence the skip where bwrap works)."""
    if _bwrap_works():
        pytest.skip("bwrap works on this machine: no backend here fails its probe")
    monkeypatch.setenv("PATH", "/nonexistent")
    probe.cache_clear()
    yield SandboxConfig(backend="bwrap")
    probe.cache_clear()


def test_no_isolation_refuses_code_and_fails_only_the_code_rows_of_default(without_bwrap):
    with pytest.raises(ValueError, match=r"^reward\.name: 'code' runs the model's programs in a sandbox "
                                         r"\(reward\.sandbox\), and the bwrap sandbox backend does not work"):
        RewardPool(None, "code", sandbox=without_bwrap)
    with pytest.raises(SandboxUnavailable):
        code_reward("code", RIGHT, None, ADD, sandbox=Sandbox(without_bwrap))
    with RewardPool(None, "default", num_workers=1, sandbox=without_bwrap) as pool:
        result = pool.score([RewardInput("code", RIGHT, None, ADD), RewardInput("openai/gsm8k", "#### 7", "7")])
    assert result.scores == [0.0, 1.0] and result.error_kinds == {"error": 1}
    assert "raised SandboxUnavailable: the bwrap sandbox backend does not work" in result.examples["error"]
