"""The driver's watchdog (rltrain/watchdog.py) without Ray: a driver that started processes which would outlive
it (children in sessions of their own, a grandchild) is SIGKILLed alone, and those processes are gone within seconds;
one that exits normally leaves none either. What the watchdog does for a real run's Ray processes is checked in
tests/rltrain/test_trainer_e2e.py (the killed run)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.watchdog import descendants
from tests.helpers import alive, alive_after

ROOT = Path(__file__).resolve().parents[2]
# a driver: the watchdog, then two sleepers in sessions of their own (as Ray's workers are), one of them starting a
# grandchild; prints the sleepers' pids once all are up, then exits when it reads a line (unless killed first)
DRIVER = """
import os, subprocess, sys, time
from rltrain.watchdog import descendants, start_watchdog
start_watchdog()
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
nested = [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(120)"]
procs = [subprocess.Popen(command, start_new_session=True) for command in (sleep, nested)]
while len(descendants(os.getpid())) < 4:   # the watchdog, two sleepers, a grandchild
    time.sleep(0.05)
time.sleep(2.5)   # the watchdog scans every second while new processes appear
print(" ".join(str(p.pid) for p in procs), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")
@pytest.mark.parametrize("ending", ["sigkill", "exit"])
def test_the_processes_a_driver_started_die_with_it(ending):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                       os.environ.get("PYTHONPATH", "")]))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    started = {}
    try:
        line = driver.stdout.readline()
        started = descendants(driver.pid)
        assert len(started) >= 4, started  # the watchdog, two sleepers, a grandchild
        assert {int(pid) for pid in line.split()} <= set(started)
        if ending == "sigkill":
            driver.send_signal(signal.SIGKILL)
        else:
            driver.stdin.write("exit\n")
            driver.stdin.flush()
        driver.wait(timeout=30)
        assert not alive_after(started, timeout_s=5)
    finally:
        driver.kill()
        for pid in started:  # what a failing watchdog left
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
