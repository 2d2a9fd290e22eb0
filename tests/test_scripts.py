"""scripts/test.sh, the README's test command and CI's: when its first stage fails, the failed tests are printed again
after the vLLM stage's output, so the tail of a CI log names them. Runs the script itself (on a planted failing
test file, with the vLLM stage stubbed) inside the .venv it manages, so its setup step has nothing to install.
Also: the first stage's two parts (RLTRAIN_TEST_PART, tests/conftest.py) each select their own tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("RLTRAIN_VENV", ROOT / ".venv")).resolve()


@pytest.mark.skipif(sys.platform != "linux" or Path(sys.prefix).resolve() != VENV,
                    reason="runs only in the .venv that scripts/setup_env.sh made (it would install into another)")
def test_failures_of_the_first_stage_are_repeated_last(tmp_path):
    failing = tmp_path / "test_demo.py"
    failing.write_text("def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 1 == 2\n")
    # the second stage's stand-ins: an environment setup that does nothing, a python that prints a line
    (tmp_path / "setup_vllm_env.sh").write_text("exit 0\n")
    fake_python = tmp_path / "fake-vllm-venv" / "bin" / "python"
    fake_python.parent.mkdir(parents=True)
    fake_python.write_text("#!/bin/sh\necho second-stage-output\nexit 5\n")
    fake_python.chmod(0o755)
    script = (ROOT / "scripts" / "test.sh").read_text()
    for original, stub in (('bash "$root/scripts/setup_vllm_env.sh"', f'bash "{tmp_path}/setup_vllm_env.sh"'),
                           ('root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)', f'root="{ROOT}"')):
        assert original in script, f"scripts/test.sh no longer has {original!r}: update this test"
        script = script.replace(original, stub)
    (tmp_path / "test.sh").write_text(script)
    env = dict(os.environ, RLTRAIN_VENV=str(VENV), RLTRAIN_VLLM_VENV=str(fake_python.parents[1]),
               RLTRAIN_VLLM_TESTS="1")
    out = subprocess.run(["bash", str(tmp_path / "test.sh"), str(failing), "-p", "no:cacheprovider"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    tail = out.stdout[out.stdout.index("second-stage-output"):]
    assert "the first stage (.venv) failed with exit 1" in tail
    assert "FAILED" in tail and "test_demo.py::test_fails" in tail
    assert "1 failed, 1 passed" in tail


@pytest.mark.parametrize("part, kept", [("kernels", {"tests/test_helpers.py"}),
                                        ("system", {"tests/test_scripts.py", "tests/test_docs.py"})])
def test_each_part_keeps_its_own_tests(part, kept):
    """scripts/test.sh runs the kernel tests beside each other and the system tests alone: RLTRAIN_TEST_PART picks."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_helpers.py", "tests/test_scripts.py", "tests/test_docs.py"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, RLTRAIN_TEST_PART=part), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    files = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert files == kept, out.stdout


def test_an_unknown_part_is_refused_by_name():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_helpers.py"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, RLTRAIN_TEST_PART="kernel"), timeout=120)
    assert out.returncode != 0 and "RLTRAIN_TEST_PART='kernel'" in out.stdout + out.stderr
