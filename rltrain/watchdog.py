"""The driver's watchdog: `start_watchdog()` makes the processes this driver starts (a local Ray's, above all) die with
it, however it dies; rltrain/ray_session.py starts it beside Ray.

A local Ray's head processes (GCS, raylet) are the driver's children and die with it even on SIGKILL, but the agents
the raylet starts (ray::DashboardAgent, ray::RuntimeEnvAgent) notice the raylet's death, then wait about 60 s on the
dead GCS before they exit (Ray 2.60, measured), and a worker's own children may outlive it. The watchdog is a small
stdlib-only process (`python -I rltrain/watchdog.py <driver pid>`: this file run alone, importing nothing of rltrain)
in a session of its own, so a signal to the driver's process group spares it. It reads a pipe only the driver holds
open and records the driver's descendants, every second while new ones appear (Ray's start), backing off to every
10 s while none do; when the pipe ends (the driver exited, normally or killed), it SIGKILLs every recorded process
still alive (matched by pid and start time, so a reused pid is never hit). Linux only (it reads /proc); on other
systems nothing is started. tests/rltrain/test_watchdog.py checks it without Ray.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

# a scan of /proc costs about 3 ms per 100 processes on a 2-core VM: once a second at Ray's start, then at most
# every 10 s (about 0.6% of a core on a node of 2,000 processes)
SCAN_INTERVAL_S = (1.0, 10.0)
# the watchdogs this process started: their pipes must stay open as long as the process (and its Ray) lives
_WATCHDOGS: list[subprocess.Popen] = []


def start_watchdog() -> subprocess.Popen | None:
    """The watchdog of this process's descendants (module docstring). Its stdin is the pipe: the write end stays in
    this process (the Popen object, never inherited) until it exits."""
    if not sys.platform.startswith("linux"):
        return None
    watchdog = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    _WATCHDOGS.append(watchdog)
    return watchdog


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of process `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            children.setdefault(stat[0], []).append((int(name), stat[1]))
    found, todo = {}, [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def watch(driver: int) -> list[int]:
    """Record `driver`'s descendants until stdin ends, then SIGKILL those still alive; returns their pids."""
    seen: dict[int, int] = {}
    shortest, longest = SCAN_INTERVAL_S
    interval = shortest
    while True:
        found = descendants(driver)
        interval = shortest if found.keys() - seen.keys() else min(2 * interval, longest)
        seen.update(found)
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], interval)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    seen.pop(os.getpid(), None)
    killed = []
    for pid, started in seen.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:  # gone meanwhile
                pass
    return killed


if __name__ == "__main__":
    watch(int(sys.argv[1]))
