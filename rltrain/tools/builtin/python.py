"""The built-in `python` tool: runs a model-written snippet in a separate, limited interpreter and returns its output.

What it does, per call:
- a fresh temporary directory as the working directory, deleted afterwards;
- `python -I -S snippet.py`: isolated mode (no PYTHON* variables, no user site, no script directory on sys.path)
  and no site-packages, so only the standard library imports; an empty environment;
- resource limits in the child: CPU time (RLIMIT_CPU, `cpu_s`), address space (RLIMIT_AS, `memory_mb`: a memory
  bomb gets MemoryError), file size (RLIMIT_FSIZE, `max_output_bytes`: stdout/stderr go to files in the temp dir,
  so a print loop is stopped at that size instead of filling the trainer's memory), no core dumps;
- a wall-clock limit (`wall_s`) covering sleeps and blocking I/O, after which the whole process group is killed;
- the child dies with its parent (PR_SET_PDEATHSIG), so a tool worker killed by the pool's timeout leaves no orphan;
- network: the child enters a new, empty network namespace (no interfaces but a down loopback) when the kernel lets
  it (root, or unprivileged user namespaces); `network_isolated()` says whether it does here. Where it cannot,
  the snippet HAS network access.

What it does NOT protect against (do not run it where these matter; use a container or gVisor/Firecracker then):
- the file system: the snippet runs as the trainer's user (root in most containers) and can read, write and delete
  anything that user can, outside the temp dir too (checkpoints, data, other users' secrets readable by it);
- processes: it can signal or ptrace other processes of the same user (the trainer itself), and spawn children
  (RLIMIT_NPROC does not bind root); the CPU/memory limits are per process, not per process tree;
- shared resources: disk space (only single files are capped), /dev/shm, CPU contention with the trainer;
- kernel or interpreter exploits, and network access where the namespace is unavailable (see above).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache

CLONE_NEWUSER, CLONE_NEWNET, PR_SET_PDEATHSIG = 0x10000000, 0x40000000, 1


def _enter_network_namespace() -> None:
    """In the child, before exec: a new network namespace (a user namespace too unless root). Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


@lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether snippets run without network here (probed once per process by a child that enters the namespace)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return subprocess.run(["/bin/true"], preexec_fn=_enter_network_namespace, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit_child(cpu_s: int, memory_bytes: int, file_bytes: int, isolate: bool):
    def apply():
        if isolate:
            _enter_network_namespace()
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


class PythonTool:
    schema = {"name": "python",
              "description": "Run a Python 3 program (standard library only, no network, no input) and return what "
                             "it prints to stdout and stderr. Print the values you need.",
              "parameters": {"type": "object", "required": ["code"],
                             "properties": {"code": {"type": "string", "description": "the program's source"}}}}

    def __init__(self, wall_s: float = 5.0, cpu_s: int = 3, memory_mb: int = 512, max_output_bytes: int = 65536):
        for name, value in (("wall_s", wall_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb),
                            ("max_output_bytes", max_output_bytes)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (got {value!r})")
        self.wall_s, self.cpu_s, self.memory_mb, self.max_output_bytes = wall_s, int(cpu_s), memory_mb, max_output_bytes

    def __call__(self, code: str) -> str:
        workdir = tempfile.mkdtemp(prefix="rltrain_python_tool_")
        try:
            return self._run(code, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, code: str, workdir: str) -> str:
        with open(os.path.join(workdir, "snippet.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        limits = _limit_child(self.cpu_s, self.memory_mb << 20, self.max_output_bytes, network_isolated())
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "snippet.py"], cwd=workdir, env={},
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=limits,
                                    start_new_session=True, close_fds=True)
            try:
                proc.wait(timeout=self.wall_s)
                verdict = self._verdict(proc.returncode)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes any children along
                proc.wait()
                verdict = f"[killed: wall-clock limit of {self.wall_s:g} s]"
        stdout, stderr = _read(out_path, self.max_output_bytes), _read(err_path, self.max_output_bytes)
        parts = [stdout.rstrip("\n")] if stdout else []
        if stderr:
            parts.append("[stderr]\n" + stderr.rstrip("\n"))
        if verdict:
            parts.append(verdict)
        return "\n".join(parts) if parts else f"[no output; ran {time.monotonic() - start:.2f} s]"

    def _verdict(self, returncode: int) -> str:
        if returncode == 0:
            return ""
        if returncode == -signal.SIGXCPU:
            return f"[killed: CPU time limit of {self.cpu_s} s]"
        if returncode == -signal.SIGKILL:  # the hard CPU limit, cpu_s + 1, or the kernel's OOM killer
            return f"[killed by SIGKILL: CPU time limit of {self.cpu_s} s or out of memory]"
        if returncode == -signal.SIGXFSZ:
            return f"[killed: output over {self.max_output_bytes} bytes]"
        if returncode < 0:
            return f"[killed by signal {signal.Signals(-returncode).name}]"
        return f"[exit code {returncode}]"


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")
