"""The python tool through the sandbox: output, exceptions, the CPU / wall-clock / memory / output limits, a fresh
scratch directory per call, the empty environment, no network, and no process left running after a call. The attacks
on the sandbox itself are tests/rltrain/sandbox/test_sandbox.py. Limits are small so the file runs in seconds."""

import os
import socket
import time
import uuid

import pytest

from rltrain.config import ConfigError
from rltrain.tools.builtin.python import PythonTool
from tests.helpers import processes_running, sandbox_unavailable

NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"needs a sandbox: {NO_SANDBOX}")


@pytest.fixture(scope="module")
def tool():
    return PythonTool(wall_s=3.0, cpu_s=1, memory_mb=256, output_bytes=4096)


@needs_sandbox
def test_prints_and_exceptions(tool):
    assert tool("print(6 * 7)\nprint('done')") == "42\ndone"
    out = tool("x = 1\nraise ValueError('bad value')")
    assert "ValueError: bad value" in out and out.startswith("[stderr]") and out.endswith("[exit code 1]")
    assert tool("pass").startswith("[no output")


@needs_sandbox
def test_runs_isolated_in_a_fresh_scratch_dir(tool):
    out = tool("import os, sys\nprint(os.getcwd())\nprint(sorted(os.environ))\nprint(sys.flags.isolated, "
               "sys.flags.no_site)\nprint(sorted(os.listdir('.')))\nopen('f.txt', 'w').write('x')")
    cwd, env, flags, listing = out.splitlines()
    assert cwd == "/scratch" and listing == "['program.py']" and flags == "1 1"   # f.txt of no earlier call
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert "f.txt" not in tool("import os\nprint(os.listdir('.'))")
    assert "No module named 'numpy'" in tool("import numpy")  # no site-packages


@needs_sandbox
def test_sleep_is_killed_at_the_wall_clock_limit(tool):
    start = time.monotonic()
    out = tool("import time\nprint('before', flush=True)\ntime.sleep(60)")
    assert out == "before\n[killed: wall-clock limit of 3 s]"
    assert 2.9 < time.monotonic() - start < 7


@needs_sandbox
def test_busy_loop_memory_bomb_and_output_flood_are_stopped(tool):
    start = time.monotonic()
    out = tool("while True:\n    pass")
    assert "[killed: CPU time limit of 1 s]" in out or "[killed: wall-clock limit" in out   # the machine's load
    out = tool("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))")
    assert "MemoryError" in out
    out = tool("while True:\n    print('y' * 1000)")
    assert out.endswith("[killed: output over 4096 bytes]") and len(out) < 4096 + 100
    assert time.monotonic() - start < 10


@needs_sandbox
def test_no_network(tool):
    server = socket.create_server(("127.0.0.1", 0))
    try:
        out = tool(f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
                   "print('connected')")
    finally:
        server.close()
    assert "connected" not in out.splitlines() and "Error: [Errno" in out   # unreachable, or its own loopback


@needs_sandbox
def test_no_process_outlives_a_call():
    """The bug this sandbox fixed: a `sleep 30` and 50 forks outlived the tool's call."""
    marker = f"30.{uuid.uuid4().int % 10**9}"   # a sleep duration no other process uses
    out = PythonTool(max_processes=64)(
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', {marker!r}], start_new_session=True)\n"
        f"for _ in range(50):\n    if os.fork() == 0:\n        os.setsid()\n        os.execv('/bin/sleep', "
        f"['sleep', {marker!r}])\nprint('left them running')")
    assert out == "left them running"
    assert processes_running(marker) == []


def test_bad_limits_are_refused():
    with pytest.raises(ConfigError, match=r"kwargs\.wall_s: must be > 0"):
        PythonTool(wall_s=0)
    with pytest.raises(ConfigError, match=r"kwargs\.timeout: unknown key"):
        PythonTool(timeout=3)
    assert os.environ.get("PATH")   # the tool never touched this process's environment
