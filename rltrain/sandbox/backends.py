"""The two ways a sandbox is built, as command lines, and what the sandbox sees of the host.

- `bwrap`: bubblewrap (Debian/Ubuntu package `bubblewrap`), the tool Flatpak builds its sandboxes with. Where
  unprivileged user namespaces are restricted to profiled programs (Ubuntu 24.04's AppArmor default), it is the one
  that works.
- `unshare`: rltrain/sandbox/launcher.py, which builds the same sandbox with the unshare(2), mount(2) and
  pivot_root(2) system calls: nothing to install, needs a kernel that lets the trainer's user create namespaces
  (user namespaces, unless it is root).

Both give the program: new user (when not root), mount, pid, network (no interface but its own loopback), IPC
and UTS namespaces; a root file system of read-only bind mounts of /usr, /bin, /lib... (the system's top-level
directories that hold programs and libraries, or symlinks to them) and of the interpreter's installation, a minimal
/dev, its own /proc, /tmp -> /scratch, and /scratch, a tmpfs of `scratch_mb` with the program in it, the only
writable place. The trainer's files (its code, data, checkpoints, home directory) are not there. No capabilities.
Under root the program runs as a uid of its own (FIRST_UID + a pid), so that RLIMIT_NPROC holds (the kernel exempts
root from it) and the files of root's are as foreign to it as any other user's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from rltrain.sandbox.config import SandboxConfig

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SCRATCH = "/scratch"
FIRST_UID = 0x7F000000   # as in launcher.py
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}


def interpreter() -> str:
    """The Python the program runs on: the trainer's base interpreter (a virtualenv's python is a link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def file_system() -> tuple[list[str], dict[str, str]]:
    """(host paths bound read-only at the same path, symlinks at the root): the system directories and the
    interpreter's installation (its prefix, when outside them)."""
    binds, symlinks = [], {}
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            symlinks[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    python = interpreter()
    for extra in (os.path.realpath(sys.base_prefix), os.path.dirname(python)):
        if not any(extra == b or extra.startswith(b + "/") for b in binds + list(symlinks)):
            binds.append(extra)
    return binds, symlinks


def program_argv() -> list[str]:
    """-I: isolated mode (no PYTHON* variables, no user site, no script directory on sys.path); -S: no site-packages,
    so the standard library is what imports."""
    return [interpreter(), "-I", "-S", "program.py"]


def run_as_user() -> int | None:
    """The uid bubblewrap is started as: under root, a uid of this process's own; else the trainer's (None)."""
    return FIRST_UID + os.getpid() if os.geteuid() == 0 else None


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def unshare_command(config: SandboxConfig, workdir: str, status_fd: int) -> tuple[list[str], tuple[int, ...]]:
    """(argv, fds to pass) of the unshare backend; the program is `workdir`/program.py, the spec written beside it."""
    binds, symlinks = file_system()
    root = os.path.join(workdir, "root")
    os.mkdir(root)
    spec = {"status_fd": status_fd, "parent": os.getpid(), "root": root, "binds": binds, "symlinks": symlinks,
            "scratch_mb": config.scratch_mb, "files": {"program.py": os.path.join(workdir, "program.py")},
            "limits": config.limits(), "argv": program_argv(), "env": ENV}
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return [interpreter(), "-I", "-S", LAUNCHER, "unshare", spec_path], (status_fd,)


def bwrap_command(config: SandboxConfig, workdir: str, status_fd: int, bwrap: str) -> tuple[list[str], tuple[int, ...]]:
    """(argv, fds to pass) of the bwrap backend. The program and the launcher are handed over as open files
    (--file, --ro-bind-data), so bubblewrap, which may run as another user, needs no access to `workdir`."""
    binds, symlinks = file_system()
    program_fd = os.open(os.path.join(workdir, "program.py"), os.O_RDONLY)
    launcher_fd = os.open(LAUNCHER, os.O_RDONLY)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--cap-drop", "ALL", "--hostname", "sandbox"]
    for path in binds:
        argv += ["--ro-bind", path, path]
    for path, target in symlinks.items():
        argv += ["--symlink", target, path]
    argv += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc",
             "--perms", "0700", "--size", str(config.scratch_mb << 20), "--tmpfs", SCRATCH,
             "--file", str(program_fd), f"{SCRATCH}/program.py", "--symlink", SCRATCH.lstrip("/"), "/tmp",
             "--ro-bind-data", str(launcher_fd), "/run/sandbox/launcher.py", "--remount-ro", "/",
             "--chdir", SCRATCH, "--clearenv"]   # the launcher gives the program ENV
    spec = {"status_fd": status_fd, "limits": config.limits(), "argv": program_argv(), "env": ENV}
    argv += ["--", interpreter(), "-I", "-S", "/run/sandbox/launcher.py", "bwrap", json.dumps(spec)]
    return argv, (status_fd, program_fd, launcher_fd)
