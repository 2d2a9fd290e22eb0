"""One run per output directory: an exclusive lock held for the run's life, and temporary directories whose names
no other run can share.

Two runs in one `trainer.output_dir` (a job launched twice, a typo) would write the same checkpoints and append to the
same metrics.jsonl. The trainer takes `OutputDirLock.acquire(output_dir)` first: `fcntl.flock` on
`<output_dir>/.lock`, which holds the holder's host, pid and start time as JSON. A second run fails at once with
`OutputDirInUse` (a ConfigError: the entry point exits 2) naming the directory, host and pid. The kernel drops a
flock when its process dies, however it dies, so a lock file left by a killed run is taken over, and the log says
whose it was; a run that ends normally empties the file.

Whatever a save writes goes to `temporary_dir(parent, stem)` (`.tmp_<stem>_<host>_<pid>`) and is renamed into place;
`remove_unfinished(output_dir)` deletes the temporaries dead runs left, which only the lock holder may do.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from rltrain.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
TEMP_PREFIX = ".tmp_"
# the folders of the output directory that saves write through temporaries (checkpoints, the warm-start cache)
TEMP_HOLDERS = ("checkpoints", "warmstart")


class OutputDirInUse(ConfigError):
    """Another live run holds the output directory's lock."""


def _holder(text: str) -> str:
    """'host H, pid P, since T' from a lock file's JSON (or the raw text where it is not ours)."""
    if not text.strip():  # locked, its record not written yet
        return "a run that is just starting"
    try:
        info = json.loads(text)
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return f"unreadable holder record {text[:80]!r}"


class OutputDirLock:
    """The output directory's lock, held by this process from acquire() to release() (or its death)."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, output_dir: str | Path) -> "OutputDirLock":
        """Lock `output_dir` (created if missing) for this process, or raise OutputDirInUse."""
        directory = Path(output_dir)
        path = directory / LOCK_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"trainer.output_dir: cannot create {str(path)!r} ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            held = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutputDirInUse(
                    f"trainer.output_dir: {str(directory)!r} is in use by another run ({_holder(held)}); two runs in "
                    "one directory overwrite each other's checkpoints and metrics: wait for that run to end or stop "
                    "it, or give this one another trainer.output_dir") from None
            # a filesystem without locks (some network mounts): run, but say what is unprotected
            logger.warning("cannot lock %s (%s): nothing stops a second run from using %s at the same time", path,
                           err.strerror, directory)
            return cls(path, None)
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:  # a run that ended normally empties the file: this one's holder died holding it
            logger.warning("took over the lock of %s left by a run that is gone (%s)", directory, _holder(previous))
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S %z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Empty the lock file and unlock it (kept, not deleted: a run that opened it meanwhile must lock this very
        file, not a new one)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


def temporary_name(parent: Path, stem: str) -> Path:
    """`parent/.tmp_<stem>_<host>_<pid>`: a name no other live process uses."""
    return Path(parent) / f"{TEMP_PREFIX}{stem}_{socket.gethostname()}_{os.getpid()}"


def temporary_dir(parent: Path, stem: str) -> Path:
    """An empty directory temporary_name(parent, stem) for this process to write and rename into place; a leftover
    of this process's own (an earlier save that raised) is cleared."""
    path = temporary_name(parent, stem)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def remove_unfinished(output_dir: str | Path) -> list[Path]:
    """Delete the temporaries that runs which died mid-save left under the output directory; the caller holds its
    lock, so none of them is being written. Returns what was removed."""
    removed = []
    for holder in TEMP_HOLDERS:
        folder = Path(output_dir) / holder
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            # also <hash>.tmp: the fixed-name warm-start temporary of earlier releases
            if entry.name.startswith(TEMP_PREFIX) or entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                removed.append(entry)
    if removed:
        logger.info("removed %d unfinished temporary director%s of dead runs: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(str(p) for p in removed))
    return removed
