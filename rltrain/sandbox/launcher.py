"""The process that builds a sandbox and starts the program in it. Standard library only: it runs outside the
trainer's environment as `python -I -S launcher.py unshare SPEC_FILE` or `... bwrap SPEC_JSON`, in one of two modes.

`unshare` (the unshare backend, rltrain/sandbox/backends.py): with the unshare(2) system call it enters new mount,
network, pid, IPC and UTS namespaces (and a user namespace unless it runs as root, its uid mapped to 0 in there),
forks the pid namespace's init, and the init builds a root of its own: a tmpfs holding read-only bind mounts of the
system directories the interpreter needs, a minimal /dev, the namespace's /proc, a size-limited tmpfs /scratch with
the program, nothing else of the host. It pivots into that root, forks the program's process, which drops every
capability (running as root: it switches to a uid of its own, FIRST_UID + the launcher's pid or, in a user namespace
that does not map it, one that it maps, so RLIMIT_NPROC binds it and two sandboxes do not share a process count),
sets its rlimits and execs the program. When the program exits the
init exits, and the kernel kills whatever is left in the pid namespace: nothing outlives a run. If the launcher is
killed, or the process that started it dies, the init dies with it (PR_SET_PDEATHSIG), taking the namespace along.

`bwrap` (the bwrap backend): bubblewrap built the namespaces and the root and dropped the capabilities; this runs as
the pid namespace's first process, starts the program under its rlimits (bubblewrap sets none) and reports its
status.

The file descriptor `status_fd` gets `init PID` (the pid namespace's first process, as the trainer sees it: it ends
once every process of the sandbox has), then the program's status, `exit N` or `signal N`, or `error MESSAGE` when
the sandbox could not be built.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 1, 2, 4, 8, 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
FIRST_UID = 0x7F000000     # running as root: the program's uid is this + the launcher's pid (unique while it runs)
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = "/scratch"

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target} ({fstype or 'bind/remount'})")


def _locked_flags(path: str) -> int:
    """The mount flags of `path` that a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    return sum(ms for st, ms in pairs if f & st)


def _bind(source: str, target: str, read_only: bool = True, extra: int = MS_NOSUID) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    try:
        _mount(source, target, None, MS_BIND)
    except SetupError:   # a user namespace refuses to bind a mount without the mounts on top of it
        _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | extra | _locked_flags(source) | (MS_RDONLY if read_only else 0)
    _mount(None, target, None, flags)


def _build_root(root: str, spec: dict, owner: tuple[int, int]) -> None:
    """The sandbox's file system under `root` (a host directory, mounted over in this mount namespace only)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)   # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in spec["binds"]:
        _bind(path, root + path)
    for name, target in spec["symlinks"].items():
        os.symlink(target, root + name)
    dev = root + "/dev"
    os.makedirs(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        _bind("/dev/" + name, f"{dev}/{name}", read_only=False, extra=MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _mount(None, dev, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)   # the devices stay writable
    os.makedirs(root + "/proc")
    try:  # refused where the host's /proc is partly masked (some containers): the program runs without one
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        pass
    scratch = root + SCRATCH
    os.makedirs(scratch)
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={spec['scratch_mb']}m,uid={owner[0]},gid={owner[1]}")
    for name, host_path in spec["files"].items():
        path = os.path.join(scratch, name)
        with open(host_path, "rb") as source, open(path, "wb") as f:
            f.write(source.read())
        os.chown(path, *owner)
    os.symlink(SCRATCH.lstrip("/"), root + "/tmp")
    _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    if hasattr(libc, "pivot_root") and libc.pivot_root(b".", b".") == 0:   # the old root stacks under the new one
        _check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    else:  # pivot_root refuses where the trainer itself runs in a chroot
        _check(libc.chroot(b"."), "chroot")
    os.chdir("/")


def _drop_privileges(run_as: tuple[int, int] | None) -> None:
    """Every capability gone for good; under root, a uid of its own."""
    for cap in range(64):   # the bounding set: no exec can give a capability back
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if run_as is not None:  # root: a uid of its own; leaving uid 0 clears every capability
        os.setgroups([])
        os.setresgid(*[run_as[1]] * 3)
        os.setresuid(*[run_as[0]] * 3)
    else:  # uid 0 of a user namespace: clear this process's capability sets too
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)    # _LINUX_CAPABILITY_VERSION_3, this process
        _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def set_limits(limits: dict, sandbox_processes: int) -> None:
    """The program's rlimits; `sandbox_processes`: the sandbox's own processes that share its process count."""
    mb = 1 << 20
    for rlimit, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] * mb),
                          (resource.RLIMIT_NPROC, limits["max_processes"] + sandbox_processes),
                          (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
                          (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        hard = value + 1 if rlimit == resource.RLIMIT_CPU else value   # SIGXCPU at the soft limit, SIGKILL 1 s on
        resource.setrlimit(rlimit, (value, hard))


def _become_init() -> None:
    """Pid 1 of the sandbox: the kernel gives it only the signals it handles, so with none handled (Python handles
    SIGINT) the program cannot stop it; not dumpable, so the program (same uid, no capability) cannot ptrace it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _start_program(spec: dict, sandbox_processes: int) -> int:
    """Fork the program's process: no inherited descriptor but 0-2, its rlimits, exec. Returns its pid."""
    program = os.fork()
    if program == 0:
        try:
            os.closerange(3, 1 << 16)
            os.chdir(SCRATCH)
            os.setsid()
            if "run_as" in spec:
                _drop_privileges(spec["run_as"])
            set_limits(spec["limits"], sandbox_processes)
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as exc:   # noqa: BLE001 - anything here is a broken sandbox, said on stderr
            os.write(2, f"sandbox: could not start the program: {exc}\n".encode())
        os._exit(126)
    return program


def _reap_until(program: int, status_fd: int) -> None:
    """Reap every process of the sandbox until `program` ends, report its status, exit (ending the namespace)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            _report(status_fd, f"signal {-code}" if code < 0 else f"exit {code}")
            os._exit(0)


def _report(status_fd: int, line: str) -> None:
    try:
        os.write(status_fd, (line + "\n").encode())
    except OSError:
        pass


def _init(spec: dict, status_fd: int, alive: int, run_as: tuple[int, int] | None) -> None:
    """Pid 1 of the new pid namespace: build the root, start the program, reap, report the program's status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.set_blocking(alive, False)
    try:
        os.read(alive, 1)   # b"": the launcher already died, before the death signal was armed
        os._exit(1)
    except BlockingIOError:
        pass
    _become_init()
    try:
        _build_root(spec["root"], spec, (0, 0) if run_as is None else run_as)
    except (SetupError, OSError) as exc:
        _report(status_fd, f"error could not build the sandbox's file system: {exc}")
        os._exit(125)
    # as root the program has a uid of its own; in a user namespace the launcher and this process share its count
    program = _start_program({**spec, "run_as": run_as}, 0 if run_as is not None else 2)
    os.close(0)
    _reap_until(program, status_fd)


def _mapped(map_path: str, preferred: int) -> int | None:
    """An id other than 0 that this user namespace maps (`preferred` if it does, else one of the map's ranges, picked
    by `preferred`), or None where only 0 is mapped."""
    with open(map_path) as f:
        ranges = [(inner, count) for inner, _, count in (map(int, line.split()) for line in f if line.strip())]
    if any(inner <= preferred < inner + count for inner, count in ranges):
        return preferred
    ranges = [(max(inner, 1), inner + count - max(inner, 1)) for inner, count in ranges if inner + count > 1]
    return None if not ranges else ranges[-1][0] + preferred % ranges[-1][1]


def run_unshare(spec: dict) -> None:
    status_fd = spec["status_fd"]
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # dies with the trainer's process that started it
    if os.getppid() != spec["parent"]:   # which died already
        sys.exit(125)
    uid, gid = os.getuid(), os.getgid()
    run_as = None
    if os.geteuid() == 0:   # a uid (and gid) of the program's own, unique while this launcher runs
        ids = [_mapped(f"/proc/self/{name}_map", FIRST_UID + os.getpid()) for name in ("uid", "gid")]
        run_as = None if None in ids else tuple(ids)
    root_user = run_as is not None   # else (root of a user namespace mapping no other id): a user namespace too
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    flags |= 0 if root_user else CLONE_NEWUSER
    try:
        _check(libc.unshare(flags), "unshare (new user, mount, network and pid namespaces)")
        if not root_user:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    except (SetupError, OSError) as exc:
        _report(status_fd, f"error {exc}")
        sys.exit(125)
    alive_read, alive_write = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(alive_write)
        _init(spec, status_fd, alive_read, run_as)
    os.close(alive_read)
    _report(status_fd, f"init {init}")   # the trainer's side waits for this process: it ends once all in it have
    _, status = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        _report(status_fd, f"error the sandbox's init process ended with {code}")
    sys.exit(0 if code == 0 else 125)


def run_in_bwrap(spec: dict) -> None:
    """Pid 1 of bubblewrap's sandbox (--as-pid-1; bubblewrap dropped the capabilities): start the program under its
    rlimits, which bubblewrap does not set, reap, report its status."""
    _become_init()
    program = _start_program(spec, 1)   # this process shares its count
    os.close(0)
    _reap_until(program, spec["status_fd"])


def main() -> None:
    mode, spec = sys.argv[1], sys.argv[2]
    if mode == "unshare":
        with open(spec) as f:
            run_unshare(json.load(f))
    else:   # bwrap
        run_in_bwrap(json.loads(spec))


if __name__ == "__main__":
    main()
