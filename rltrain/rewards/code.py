"""The built-in `code` reward: run the program in the response against the row's tests, in the sandbox
(rltrain/sandbox/, `reward.sandbox`).

The program is the last ```python (or ```py) fenced block of the response, else its last fenced block, else the whole
response. The tests come from `extra_info["tests"]`, in one of two forms:

- input/output pairs, `[{"input": "1 2\\n", "output": "3\\n"}, ...]`: the program runs once per pair with `input` on
  stdin; it passes when it exits with 0 and its stdout matches `output` (both stripped, each line's trailing spaces
  ignored);
- assert lines, `["assert add(1, 2) == 3", ...]`: they run after the program, in one run; it passes when the
  asserts all ran: the run prints, after them, a token the program is not given. Exiting early (`sys.exit(0)`,
  `os._exit(0)`), a known reward hack, skips the token and fails; only a program that digs the token out of its
  interpreter's frames could forge it.

Without `extra_info["tests"]`, `ground_truth` is read the way verl's code data sets store it (APPS, TACO,
CodeContests, Codeforces): `{"inputs": [...], "outputs": [...]}`, as a dict or as its JSON text.

Score: all or nothing. 1.0 when every test passes, else 0.0, and the tests stop at the first failure. Partial credit
(verl scores these data sets with prime_code's pass rate over their first 10 tests) pays a program that prints a
constant for the tests whose answer it happens to be, or special-cases the visible examples; DeepCoder (Agentica,
2025) chose all or nothing for that reason. Returned as {"score", "tests": the count run, "timed_out": 1.0 when a run
hit the wall-clock limit}; the extra numbers are logged as reward/tests_mean and reward/timed_out_mean.

A program that fails, crashes, is killed or times out scores 0: that is the policy's answer being wrong, not the reward
failing. Rows without tests, tests in neither form, and a sandbox that cannot run raise, so the pool scores the sample
0 and counts it in reward/errors.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping

from rltrain.sandbox import Sandbox

FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
PYTHON_TAGS = ("python", "py", "python3")


def extract_program(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole text."""
    blocks = FENCE.findall(text)
    python = [body for tag, body in blocks if tag.lower() in PYTHON_TAGS]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def load_tests(ground_truth, extra_info: dict | None) -> list:
    """The row's tests: a list of {"input", "output"} dicts or a list of assert lines. ValueError when none."""
    tests = (extra_info or {}).get("tests")
    if tests is None:
        tests = ground_truth
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except ValueError:
                raise ValueError("the row has no extra_info['tests'], and its ground_truth is not the JSON of "
                                 "{\"inputs\": [...], \"outputs\": [...]}") from None
        if isinstance(tests, Mapping):
            if "fn_name" in tests:
                raise ValueError("call-based tests (ground_truth with 'fn_name') are not supported: give "
                                 "extra_info['tests'] as assert lines instead")
            inputs, outputs = tests.get("inputs"), tests.get("outputs")
            if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
                raise ValueError("ground_truth must hold 'inputs' and 'outputs', two lists of one length")
            tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"the row's tests must be a non-empty list, got {str(tests)[:80]!r}")
    tests = list(tests)
    if all(isinstance(t, str) for t in tests):
        return tests
    if all(isinstance(t, Mapping) and "input" in t and "output" in t for t in tests):
        return [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    raise ValueError("the row's tests must all be {\"input\", \"output\"} pairs or all assert lines (strings)")


ASSERT_HARNESS = """import sys


def _run():
    token = sys.stdin.readline().strip()   # not in this file: the program cannot read it from here
    scope = {{"__name__": "__main__"}}
    exec(compile({program!r}, "solution.py", "exec"), scope)
    exec(compile({tests!r}, "tests.py", "exec"), scope)
    print("\\n" + token)   # on a line of its own, whatever the program printed last


_run()
"""


def run_asserts(sandbox: Sandbox, program: str, tests: list[str]):
    """(passed, SandboxResult) of the program followed by its assert lines."""
    token = uuid.uuid4().hex
    result = sandbox.run(ASSERT_HARNESS.format(program=program, tests="\n".join(tests) + "\n"), token + "\n")
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)
    return result.ok and lines[-1] == token, result


def same_output(actual: str, expected: str) -> bool:
    def lines(text):
        return [line.rstrip() for line in text.strip().splitlines()]
    return lines(actual) == lines(expected)


def code_reward(data_source, solution_str, ground_truth, extra_info=None, sandbox: Sandbox | None = None) -> dict:
    sandbox = sandbox or Sandbox()
    program, tests = extract_program(solution_str), load_tests(ground_truth, extra_info)
    if isinstance(tests[0], str):   # assert lines: one run
        passed, result = run_asserts(sandbox, program, tests)
        return {"score": float(passed), "tests": 1.0, "timed_out": float(result.timed_out)}
    for run, test in enumerate(tests, 1):
        result = sandbox.run(program, test["input"])
        if not (result.ok and same_output(result.stdout, test["output"])):
            return {"score": 0.0, "tests": float(run), "timed_out": float(result.timed_out)}
    return {"score": 1.0, "tests": float(len(tests)), "timed_out": 0.0}
