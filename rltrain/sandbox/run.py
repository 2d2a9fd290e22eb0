"""Run a Python program in a sandbox and collect what it printed:

    sandbox = Sandbox(SandboxConfig(wall_s=5))
    result = sandbox.run("print(int(input()) * 2)", stdin="21\\n")   # SandboxResult(stdout='42\\n', exit_code=0, ...)

The backend is chosen once per process by a probe (`probe`): a small program run through bwrap, then unshare (or
only the one `backend` names) that must see no network interface but the loopback and none of the trainer's files,
and find its process limit binding. The choice is logged; where none works, `SandboxUnavailable` says why for each,
and nothing runs unsandboxed.

Every run ends with every process it started: the sandbox's pid namespace dies with its first process, whose end
this side waits for (a pidfd) after the program exits, after the wall-clock limit (`wall_s`) kills it, after its
output passes `output_bytes`, when the caller is interrupted (a reward's own timeout), and when the caller's process
dies (the launcher and bubblewrap die with their parent, the namespace with them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from rltrain.config import from_mapping
from rltrain.sandbox import backends
from rltrain.sandbox.config import SandboxConfig

logger = logging.getLogger(__name__)
END_GRACE_S = 5.0   # after a kill: how long the sandbox's processes may take to be gone before it is an error
READ_BYTES = 1 << 16
PROBE_PROCESSES = 4
PROBE = f"""import os, socket, time
interfaces = [name for _, name in socket.if_nameindex()]
assert interfaces in ([], ['lo']), f"network interfaces {{interfaces}}"
assert not os.path.exists({backends.LAUNCHER!r}), "the trainer's files are visible"
started = 0
try:
    while started < {2 * PROBE_PROCESSES}:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
except OSError:
    pass
assert started < {PROBE_PROCESSES}, "RLIMIT_NPROC does not bind (the sandbox's uid is root outside it)"
print("isolated")
"""


class SandboxUnavailable(RuntimeError):
    """No backend can build a sandbox on this machine (the message says why for each)."""


class SandboxError(RuntimeError):
    """The sandbox could not be built or did not report how its program ended."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None      # None when it was killed
    timed_out: bool = False    # killed at the wall-clock limit
    killed: str | None = None  # why it was stopped: the limit it hit, or the signal that ended it
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def _signal_reason(number: int, config: SandboxConfig) -> str:
    if number == signal.SIGXCPU:
        return f"CPU time limit of {config.cpu_s} s"
    if number == signal.SIGXFSZ:
        return f"file size limit of {config.file_size_mb} MB"
    if number == signal.SIGKILL:
        return f"SIGKILL (the hard CPU time limit of {config.cpu_s + 1} s, or the out-of-memory killer)"
    return f"signal {signal.Signals(number).name}" if number in signal.valid_signals() else f"signal {number}"


class _Run:
    """One launched sandbox: its launcher process, its output and status pipes, and the pidfd of its init."""

    def __init__(self, backend: str, config: SandboxConfig, workdir: str, stdin_path: str):
        self.config, self.status = config, b""
        self.init_pidfd: int | None = None
        self.status_read, status_write = os.pipe()
        os.set_blocking(self.status_read, False)
        try:
            user = None
            if backend == "bwrap":
                argv, fds = backends.bwrap_command(config, workdir, status_write, backends.find_bwrap() or "bwrap")
                info = os.dup(status_write)   # bubblewrap's --info-fd (it closes that one in the sandbox)
                argv[1:1], fds = ["--info-fd", str(info)], (*fds, info)
                user = backends.run_as_user()
            else:
                argv, fds = backends.unshare_command(config, workdir, status_write)
            try:
                with open(stdin_path, "rb") as stdin:
                    self.proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 pass_fds=fds, start_new_session=True, env={}, user=user,
                                                 group=user, extra_groups=[] if user is not None else None)
            finally:
                for fd in fds:
                    if fd != status_write:
                        os.close(fd)
        except BaseException:
            os.close(self.status_read)
            raise
        finally:
            os.close(status_write)

    def _read(self) -> bool:
        """Read what the status pipe holds; True once every writer has closed it."""
        while True:
            try:
                chunk = os.read(self.status_read, READ_BYTES)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            self.status += chunk

    def read_status(self) -> bool:
        """Read the status pipe; open the init's pidfd once its pid is known. True once every writer closed it."""
        closed = self._read()
        match = re.search(rb'^init (\d+)$|"child-pid": (\d+)', self.status, re.M) if self.init_pidfd is None else None
        if match:
            try:
                self.init_pidfd = os.pidfd_open(int(match.group(1) or match.group(2)))
            except ProcessLookupError:
                self.init_pidfd = -1
            closed = self._read() or closed
            if self.init_pidfd >= 0 and re.search(rb"^(exit|signal) ", self.status, re.M):
                # the program had ended: the init may have been reaped before the pidfd opened, and its pid reused;
                # the launcher's exit says the namespace is gone then
                os.close(self.init_pidfd)
                self.init_pidfd = -1
        return closed

    def collect(self, deadline: float) -> tuple[bytes, bytes, str | None]:
        """(stdout, stderr, why it must be killed or None): read until both streams close, the limit or the cap."""
        cap = self.config.output_bytes
        streams = {self.proc.stdout: bytearray(), self.proc.stderr: bytearray()}
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                os.set_blocking(stream.fileno(), False)
                selector.register(stream, selectors.EVENT_READ)
            selector.register(self.status_read, selectors.EVENT_READ)
            open_streams = len(streams)
            while open_streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(streams[self.proc.stdout]), bytes(streams[self.proc.stderr]), "wall"
                for key, _ in selector.select(left):
                    if key.fileobj == self.status_read:
                        if self.read_status():
                            selector.unregister(self.status_read)
                        continue
                    chunk = os.read(key.fd, READ_BYTES)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    kept = streams[key.fileobj]
                    kept += chunk
                    if len(kept) > cap:
                        del kept[cap:]
                        return bytes(streams[self.proc.stdout]), bytes(streams[self.proc.stderr]), "output"
        out, err = bytes(streams[self.proc.stdout]), bytes(streams[self.proc.stderr])
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return out, err, "wall"
        return out, err, None

    def end(self, kill: bool) -> None:
        """Kill the sandbox (when `kill`) and wait until none of its processes is left."""
        self.read_status()
        if kill:
            if self.init_pidfd is not None and self.init_pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)   # the whole pid namespace
                except ProcessLookupError:
                    pass
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)   # the launcher; its init dies with it
        try:
            self.proc.wait(timeout=END_GRACE_S)
            if self.init_pidfd is not None and self.init_pidfd >= 0:
                poller = select.poll()   # readable once the init has ended, which is after every other process
                poller.register(self.init_pidfd, select.POLLIN)
                if not poller.poll(END_GRACE_S * 1000):
                    raise SandboxError(f"the sandbox's processes were not gone {END_GRACE_S:g} s after it ended")
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                stream.close()
            if self.init_pidfd is not None and self.init_pidfd >= 0:
                os.close(self.init_pidfd)
            self.read_status()
            os.close(self.status_read)


def execute(backend: str, config: SandboxConfig, program: str, stdin: str | bytes = "") -> SandboxResult:
    """Run `program` once through `backend` (bwrap | unshare), no probe. Raises SandboxError when the sandbox could
    not be built."""
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rltrain_sandbox_")
    try:
        with open(os.path.join(workdir, "program.py"), "w") as f:
            f.write(program)
        stdin_path = os.path.join(workdir, "stdin")
        with open(stdin_path, "wb") as f:
            f.write(stdin.encode() if isinstance(stdin, str) else stdin)
        run = _Run(backend, config, workdir, stdin_path)
        stop = "interrupted"
        try:
            out, err, stop = run.collect(start + config.wall_s)
        finally:
            run.end(kill=stop is not None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), None,
                           elapsed_s=time.monotonic() - start)
    if stop == "wall":
        result.timed_out, result.killed = True, f"wall-clock limit of {config.wall_s:g} s"
        return result
    if stop == "output":
        result.killed = f"output over {config.output_bytes} bytes"
        return result
    status = run.status.decode("utf-8", "replace")
    outcome = re.search(r"^(exit|signal|error) (.*)$", status, re.M)
    if outcome is None or outcome.group(1) == "error":
        why = outcome.group(2) if outcome else f"it ended ({backend} exit code {run.proc.returncode}) without " \
                                               f"reporting the program's status"
        raise SandboxError(f"the {backend} sandbox failed: {why}" + (f"; its stderr: {result.stderr[-2000:]}"
                                                                        if result.stderr else ""))
    if outcome.group(1) == "exit":
        result.exit_code = int(outcome.group(2))
    else:
        result.killed = _signal_reason(int(outcome.group(2)), config)
    return result


@lru_cache(maxsize=None)
def probe(preference: str = "auto") -> str:
    """The backend this process runs sandboxes with (`preference`: auto | bwrap | unshare), tried once per process
    and logged. Raises SandboxUnavailable, with each candidate's reason, when none works."""
    candidates = ("bwrap", "unshare") if preference == "auto" else (preference,)
    reasons = []
    for backend in candidates:
        if backend == "bwrap" and backends.find_bwrap() is None:
            reasons.append("bwrap: not installed (no `bwrap` on PATH)")
            continue
        try:
            result = execute(backend, SandboxConfig(wall_s=30, max_processes=PROBE_PROCESSES), PROBE)
        except (SandboxError, OSError) as exc:
            reasons.append(f"{backend}: {exc}")
            continue
        if result.ok and result.stdout.strip() == "isolated":
            logger.info("sandbox: programs run under %s (%s), probed in %.2f s", backend, DESCRIPTIONS[backend],
                        result.elapsed_s)
            return backend
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:]   # the assertion's message
        reasons.append(f"{backend}: the probe program did not run isolated (exit code {result.exit_code}"
                       f"{', ' + result.killed if result.killed else ''}): {' '.join(said)[:500]}")
    if os.geteuid() == 0 and "bwrap" in candidates and backends.find_bwrap():
        reasons.append("under root, bwrap runs as a uid of its own (so that RLIMIT_NPROC binds), which must be able to "
                       f"read the interpreter, {backends.interpreter()}, and its installation")
    what = "no sandbox backend works" if preference == "auto" else f"the {preference} sandbox backend does not work"
    raise SandboxUnavailable(f"{what} on this machine, so no program is run (never without isolation): "
                             + "; ".join(reasons) + ". Install bubblewrap (Debian/Ubuntu: apt-get "
                             "install bubblewrap) or allow unprivileged user namespaces (sysctl "
                             "user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 on older Debian "
                             "kernels; kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10 and later)")


DESCRIPTIONS = {"bwrap": "bubblewrap: user, mount, pid, network, IPC and UTS namespaces",
                "unshare": "unshare(2): mount, pid, network, IPC and UTS namespaces, a user namespace unless root"}


class Sandbox:
    """`Sandbox(config).run(program, stdin) -> SandboxResult`. Probes the backend at the first run (or `check()`)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = from_mapping(SandboxConfig, dataclasses.asdict(config or SandboxConfig()), "sandbox")

    @property
    def backend(self) -> str:
        """The backend runs use; raises SandboxUnavailable when none works here."""
        return probe(self.config.backend)

    def run(self, program: str, stdin: str | bytes = "") -> SandboxResult:
        """Run the Python program `program` (standard library only) with `stdin`. Raises SandboxUnavailable (no
        isolation here) or SandboxError (the sandbox broke); a program that fails, crashes or is killed is a
        result."""
        return execute(self.backend, self.config, program, stdin)
