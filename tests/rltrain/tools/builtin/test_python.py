"""The sandboxed python tool: output, exceptions, the CPU / wall-clock / memory / output limits, the temp dir, the
empty environment and (where the kernel allows it) no network. Limits are small so the file runs in seconds."""

import os
import socket
import time

import pytest

from rltrain.tools.builtin.python import PythonTool, network_isolated


@pytest.fixture(scope="module")
def sandbox():
    return PythonTool(wall_s=3.0, cpu_s=1, memory_mb=256, max_output_bytes=4096)


def test_prints_and_exceptions(sandbox):
    assert sandbox("print(6 * 7)\nprint('done')") == "42\ndone"
    out = sandbox("x = 1\nraise ValueError('bad value')")
    assert "ValueError: bad value" in out and out.startswith("[stderr]") and out.endswith("[exit code 1]")
    assert sandbox("pass").startswith("[no output")


def test_runs_isolated_in_a_fresh_temp_dir(sandbox):
    out = sandbox("import os, sys\nprint(os.getcwd())\nprint(dict(os.environ))\nprint(sys.flags.isolated, "
                  "sys.flags.no_site)\nopen('f.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    cwd, env, flags, listing = out.splitlines()
    assert os.path.basename(cwd).startswith("rltrain_python_tool_") and not os.path.exists(cwd)  # removed after
    assert "PATH" not in env and "PYTHONPATH" not in env and flags == "1 1"
    assert "'f.txt'" in listing and "'snippet.py'" in listing
    assert "No module named 'numpy'" in sandbox("import numpy")  # no site-packages


def test_sleep_is_killed_at_the_wall_clock_limit(sandbox):
    start = time.monotonic()
    out = sandbox("import time\nprint('before', flush=True)\ntime.sleep(60)")
    assert "[killed: wall-clock limit of 3 s]" in out and out.startswith("before")
    assert 2.9 < time.monotonic() - start < 8


def test_busy_loop_is_stopped(sandbox):
    start = time.monotonic()
    out = sandbox("while True:\n    pass")
    assert "CPU time limit" in out or "wall-clock limit" in out  # which comes first depends on the machine's load
    assert time.monotonic() - start < 8


def test_memory_bomb_is_stopped(sandbox):
    start = time.monotonic()
    out = sandbox("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))")
    assert "MemoryError" in out and time.monotonic() - start < 8


def test_output_flood_is_capped(sandbox):
    out = sandbox("while True:\n    print('y' * 1000)")
    assert len(out) < 4096 + 1000 and "File too large" in out


@pytest.mark.skipif(not network_isolated(), reason="this kernel lets no child enter a new network namespace")
def test_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        out = PythonTool(wall_s=5)(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                                   "print('connected')")
    finally:
        server.close()
    assert "connected" not in out and "OSError" in out


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        PythonTool(wall_s=0)
