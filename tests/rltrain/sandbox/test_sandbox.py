"""The sandbox against what a model's program tries: a fork bomb, an infinite loop, a memory blow-up, writing outside
its scratch directory, reading the trainer's files, opening sockets, killing its parent, leaving children running;
each test checks the sandbox held and the machine is as it was (nothing left running, no file written, ...). Every
backend that works on this machine runs each test; one that does not is skipped with the probe's reason. The refusal
where none works is tested on every machine (a failing probe is simulated). About 10 s on 2 cores.

    PYTHONPATH=$PWD:$PWD/kernels .venv/bin/python -m pytest -q tests/rltrain/sandbox/test_sandbox.py
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from rltrain.config import ConfigError, from_mapping
from rltrain.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxUnavailable, probe
from rltrain.sandbox import run as sandbox_run
from tests.helpers import alive_after, processes_running

LIMITS = dict(wall_s=5.0, cpu_s=2, memory_mb=256, max_processes=8, file_size_mb=1, scratch_mb=4, output_bytes=4096)


def _why_not(backend: str) -> str | None:
    try:
        probe(backend)
    except SandboxUnavailable as exc:
        return str(exc)
    return None


BACKENDS = [pytest.param(b, id=b, marks=pytest.mark.skipif(_why_not(b) is not None, reason=str(_why_not(b))))
            for b in ("bwrap", "unshare")]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _sandbox(backend, **limits) -> Sandbox:
    return Sandbox(SandboxConfig(backend=backend, **{**LIMITS, **limits}))


def _tagged(program: str) -> tuple[str, str]:
    """(marker, program re-executing itself with `marker` in its command line, so its processes can be found)."""
    marker = f"rltrain-sandbox-test-{uuid.uuid4().hex}"
    head = f"import os, sys\nif len(sys.argv) == 1:\n    os.execv(sys.executable, [sys.executable, '-I', '-S', " \
           f"'program.py', {marker!r}])\n"
    return marker, head + program


def test_runs_a_program_with_its_input(backend):
    sandbox = _sandbox(backend)
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", "40 2\n")
    assert (result.stdout, result.exit_code, result.killed, result.timed_out) == ("42\n", 0, None, False)
    failed = sandbox.run("import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.stdout, failed.exit_code) == ("partial\n", 3)
    crashed = sandbox.run("raise ValueError('bad value')")
    assert crashed.exit_code == 1 and "ValueError: bad value" in crashed.stderr
    assert "No module named 'pytest'" in sandbox.run("import pytest").stderr   # the standard library only


def test_fork_bomb_stops_at_max_processes(backend):
    counted = _sandbox(backend).run("import os, time\ncount = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                                    "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n"
                                    "        os._exit(0)\n    count += 1\nprint(count)")
    assert counted.stdout == f"{LIMITS['max_processes'] - 1}\n", counted   # the program itself is one of them
    marker, bomb = _tagged("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    start = time.monotonic()
    result = _sandbox(backend, wall_s=1.5).run(bomb)
    assert result.timed_out and time.monotonic() - start < 6
    assert processes_running(marker) == []


def test_infinite_loop_and_sleep_are_killed(backend):
    start = time.monotonic()
    spin = _sandbox(backend, cpu_s=1).run("while True:\n    pass")
    assert spin.exit_code is None and spin.killed in ("CPU time limit of 1 s", "wall-clock limit of 5 s"), spin
    assert time.monotonic() - start < 7
    start = time.monotonic()
    sleep = _sandbox(backend, wall_s=1).run("import time\nprint('before', flush=True)\ntime.sleep(60)")
    assert sleep.timed_out and sleep.killed == "wall-clock limit of 1 s" and sleep.stdout == "before\n"
    assert 1 <= time.monotonic() - start < 4


def test_memory_blow_up_fails_its_allocation(backend):
    result = _sandbox(backend).run("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_writes_outside_scratch_fail(backend, tmp_path):
    outside = tmp_path / "written-by-the-sandbox.txt"
    targets = [str(outside), "/usr/pwned", "/pwned", "/dev/pwned", backends_prefix() + "/pwned"]
    result = _sandbox(backend).run(
        f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as exc:\n        print('refused', exc.errno)\n"
        "open('/scratch/a.txt', 'w').write('ok')\nopen('/tmp/b.txt', 'w').write('ok')\nimport os\n"
        "print(sorted(os.listdir('.')))\n"
        "try:\n    open('big', 'wb').write(bytes(2 << 20))\nexcept OSError as exc:\n    print('big:', exc.strerror)\n"
        "os.remove('big')\ntry:\n    for i in range(8):\n        open(f'fill{i}', 'wb').write(bytes(1 << 20))\n"
        "except OSError as exc:\n    print('fill:', exc.strerror)")
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == len(targets), result
    assert "['a.txt', 'b.txt', 'program.py']" in result.stdout   # /tmp is the scratch directory
    assert "big: File too large" in result.stdout and "fill: No space left on device" in result.stdout
    assert not outside.exists()


def backends_prefix() -> str:
    from rltrain.sandbox.backends import interpreter
    return os.path.dirname(os.path.dirname(interpreter()))


def test_the_trainers_files_and_environment_are_out_of_reach(backend, tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-FILE-CONTENT")
    monkeypatch.setenv("RLTRAIN_TEST_SECRET", "SECRET-ENV-CONTENT")
    result = _sandbox(backend).run(
        f"import os\nfor path in [{str(secret)!r}, {__file__!r}, '/etc/passwd', '/proc/{os.getpid()}/environ']:\n"
        "    try:\n        print(open(path).read()[:200])\n"
        "    except OSError as exc:\n        print('refused', exc.errno)\n"
        "print(dict(os.environ))\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    for name in ('environ', 'cmdline'):\n        try:\n"
        "            print(open(f'/proc/{pid}/{name}', 'rb').read())\n        except OSError:\n            pass\n"
        "print(open('/proc/self/status').read())")
    assert result.exit_code == 0, result
    assert "SECRET" not in result.stdout and result.stdout.count("refused") == 4
    status = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0 and status["NoNewPrivs"].strip() == "1"


def test_no_socket_reaches_the_host(backend):
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0rltrain-sandbox-test-{uuid.uuid4().hex}")   # an abstract socket: no file, the network namespace's
    unix.listen()
    try:
        result = _sandbox(backend).run(
            "import socket\n"
            f"for family, address in [(socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]})), "
            f"(socket.AF_UNIX, {unix.getsockname()!r})]:\n"
            "    try:\n        socket.socket(family).connect(address)\n        print('CONNECTED', address)\n"
            "    except OSError as exc:\n        print('refused', exc.errno)\n"
            "try:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))\n"
            "    print('SENT')\nexcept OSError as exc:\n    print('refused', exc.errno)\n"
            "print([name for _, name in socket.if_nameindex()])")
        for server in (tcp, unix):
            server.setblocking(False)
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        tcp.close()
        unix.close()
    assert "CONNECTED" not in result.stdout and "SENT" not in result.stdout and result.stdout.count("refused") == 3
    assert result.stdout.endswith("['lo']\n")


def test_killing_the_parent_and_everyone_fails(backend):
    targets = [(os.getppid(), signal.SIGKILL), (1, signal.SIGINT), (1, signal.SIGTERM), (1, signal.SIGKILL),
               (os.getpid(), signal.SIGKILL), (os.getppid(), signal.SIGKILL), (-1, signal.SIGKILL)]
    result = _sandbox(backend).run(
        f"import os\nfor pid, number in {[(pid, int(number)) for pid, number in targets]!r}:\n"
        "    try:\n        os.kill(pid, number)\n        print('signalled', pid)\n"
        "    except OSError as exc:\n        print('refused', pid, exc.errno)\nprint(os.getppid(), 'still here')")
    # the sandbox's first process ignores them all, and the trainer's pids do not exist in there (ESRCH)
    assert result.exit_code == 0 and result.stdout.endswith("1 still here\n"), result
    assert f"refused {os.getpid()} 3" in result.stdout and f"refused {os.getppid()} 3" in result.stdout


def test_no_process_outlives_a_run(backend):
    """Today's bug: a `sleep 30` and 50 forks outlived the python tool. Here after a normal end and a wall-clock kill;
    the shell and the forks carry the marker in their command lines."""
    for ending, limits in (("print('done')", {}), ("import time\ntime.sleep(60)", {"wall_s": 1})):
        marker, program = _tagged(
            "import subprocess, time\n"
            "subprocess.Popen(['sh', '-c', 'sleep 30; : ' + sys.argv[1]], start_new_session=True)\n"
            "for _ in range(50):\n"
            "    if os.fork() == 0:\n        os.setsid()\n        time.sleep(30)\n        os._exit(0)\n"
            f"{ending}\n")
        result = _sandbox(backend, max_processes=64, **limits).run(program)
        assert result.stdout == "done\n" or result.timed_out, result
        assert processes_running(marker) == [], f"{ending!r}: processes left running"


def test_output_flood_is_cut_at_the_cap(backend):
    result = _sandbox(backend).run("while True:\n    print('y' * 1000)")
    assert result.killed == "output over 4096 bytes" and len(result.stdout) == 4096


def test_bad_limits_name_the_key():
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.wall_s: must be > 0 \(got 0"):
        from_mapping(SandboxConfig, {"wall_s": 0}, "reward.sandbox")
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.backend: must be one of auto, bwrap, unshare"):
        from_mapping(SandboxConfig, {"backend": "docker"}, "reward.sandbox")


@pytest.fixture
def no_isolation(monkeypatch):
    """A machine where no backend works: bwrap absent, the unshare launcher refused by the kernel."""
    def refused(backend, config, program, stdin=""):
        raise SandboxError(f"the {backend} sandbox failed: unshare (new user, mount, network and pid namespaces): "
                           "Operation not permitted (errno 1)")
    monkeypatch.setattr(sandbox_run.backends, "find_bwrap", lambda: None)
    monkeypatch.setattr(sandbox_run, "execute", refused)
    probe.cache_clear()
    yield
    probe.cache_clear()


def test_no_isolation_means_nothing_runs(no_isolation):
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox().run("print('unsandboxed')")
    message = str(err.value)
    assert message.startswith("no sandbox backend works on this machine, so no program is run")
    assert "bwrap: not installed" in message and "unshare: the unshare sandbox failed" in message


def test_no_isolation_refuses_the_code_reward_and_the_python_tool_up_front(no_isolation):
    from rltrain.rewards.pool import check_reward_settings
    from rltrain.tools import MultiTurnConfig
    from rltrain.workers.reward import RewardConfig
    with pytest.raises(ValueError, match=r"^reward\.name: 'code' runs the model's programs in a sandbox "
                                         r"\(reward\.sandbox\), and no sandbox backend works on this machine"):
        check_reward_settings(None, "code", timeout_s=10, num_workers=1)
    with pytest.raises(ConfigError, match=r"^reward\.name: 'code' runs"):   # the job's check: exit 2 at start
        from_mapping(RewardConfig, {"name": "code"}, "reward")
    check_reward_settings(None, "default", timeout_s=10, num_workers=1)   # code rows fail when they come
    with pytest.raises(ConfigError, match=r"^rollout\.multi_turn\.tools\[1\]: the python tool runs the model's "
                                         r"programs in a sandbox, and no sandbox backend works"):
        from_mapping(MultiTurnConfig, {"enabled": True, "tools": [{"builtin": "calculator"}, {"builtin": "python"}]},
                     "rollout.multi_turn")


def test_a_killed_caller_leaves_no_sandbox_behind(backend):
    """A reward's own timer (SIGALRM) interrupting a run: the sandbox is killed on the way out."""
    marker, program = _tagged("import time\ntime.sleep(60)\n")

    def interrupt(signum, frame):
        raise TimeoutError("the caller's timer")
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(TimeoutError):
            _sandbox(backend, wall_s=30).run(program)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert processes_running(marker) == []


def test_a_dead_caller_leaves_no_sandbox_behind(backend, tmp_path):
    """The process that started a run SIGKILLed mid-run (a tool worker past the pool's timeout): the sandbox dies with
    it (its temporary directory, in tmp_path here, stays: nobody is left to remove it)."""
    marker, program = _tagged("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    caller = subprocess.Popen([sys.executable, "-c", "import sys\nfrom rltrain.sandbox import Sandbox, SandboxConfig\n"
                               f"Sandbox(SandboxConfig(backend={backend!r}, wall_s=60)).run(sys.stdin.read())"],
                              stdin=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)})
    caller.stdin.write(program)
    caller.stdin.close()
    deadline = time.monotonic() + 20
    while not processes_running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = processes_running(marker)
    caller.kill()
    caller.wait()
    assert running, "the sandboxed program never started"
    assert alive_after(running, timeout_s=3) == [] and processes_running(marker) == []


@pytest.mark.parametrize("overrides, message", [
    (["reward.name=code", "reward.sandbox.backend=bwrap"],
     "reward.name: 'code' runs the model's programs in a sandbox (reward.sandbox), and the bwrap sandbox backend does "
     "not work on this machine"),
    (["rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[{builtin: python, kwargs: {backend: bwrap}}]"],
     "rollout.multi_turn.tools[0]: the python tool runs the model's programs in a sandbox, and the bwrap sandbox "
     "backend does not work"),
    (["reward.sandbox.max_processes=0"], "reward.sandbox.max_processes: must be >= 1 (got 0)"),
], ids=["code-reward", "python-tool", "bad-limit"])
def test_the_job_config_refuses_before_any_work(monkeypatch, overrides, message):
    """What `python -m rltrain.main_grpo` reports with exit status 2 (a ConfigError) before Ray starts: here bwrap
    out of PATH is the machine without isolation, so the case holds on every machine."""
    from rltrain.job import load_job_config
    from tests.rltrain.tiny_job import compose
    monkeypatch.setenv("PATH", "/nonexistent")
    probe.cache_clear()
    try:
        with pytest.raises(ConfigError) as err:
            load_job_config(compose(*overrides))
    finally:
        probe.cache_clear()
    assert str(err.value).startswith(message), err.value
