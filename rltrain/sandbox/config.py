"""SandboxConfig: the limits and the backend of a sandboxed program run (`reward.sandbox`, and the `python` tool's
constructor arguments). Every limit binds each run of a program; memory and CPU time bind each of its processes."""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config import require

BACKENDS = ("auto", "bwrap", "unshare")


@dataclass
class SandboxConfig:
    backend: str = "auto"        # auto | bwrap | unshare: auto takes the first of bwrap, unshare that works here
    wall_s: float = 10.0         # one run, sleeps and blocked reads included; past it every process of it is killed
    cpu_s: int = 5               # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 1024        # address space per process (RLIMIT_AS): past it allocations fail (MemoryError)
    max_processes: int = 16      # processes and threads at once (RLIMIT_NPROC): a fork bomb stops there
    file_size_mb: int = 16       # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64         # file descriptors per process (RLIMIT_NOFILE)
    scratch_mb: int = 64         # /scratch, its working directory and only writable place (a tmpfs of this size)
    output_bytes: int = 65536    # of stdout and of stderr each; past it the run is killed

    def validate(self):
        require(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}", self.backend)
        require(self.wall_s > 0, "wall_s", "must be > 0", self.wall_s)
        require(self.cpu_s >= 1, "cpu_s", "must be >= 1", self.cpu_s)
        require(self.memory_mb >= 64, "memory_mb", "must be >= 64 (the interpreter's own needs)", self.memory_mb)
        require(self.max_processes >= 1, "max_processes", "must be >= 1", self.max_processes)
        require(self.file_size_mb >= 1, "file_size_mb", "must be >= 1", self.file_size_mb)
        require(self.open_files >= 16, "open_files", "must be >= 16 (the interpreter's own needs)", self.open_files)
        require(self.scratch_mb >= 1, "scratch_mb", "must be >= 1", self.scratch_mb)
        require(self.output_bytes >= 1, "output_bytes", "must be >= 1", self.output_bytes)

    def limits(self) -> dict:
        """The rlimits, as the launcher takes them."""
        return {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "max_processes": self.max_processes,
                "file_size_mb": self.file_size_mb, "open_files": self.open_files}
