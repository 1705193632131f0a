"""The run directory's lock: one job writes a run directory at a time.

``RUN/.hpcgnn.lock`` holds a POSIX record lock (``fcntl.lockf``) taken by rank 0 of the job that
writes the run, for as long as that process lives: the kernel drops it when the process ends,
however it ends (SIGKILL and the OOM killer included), so there is nothing stale to clean up. The
file also holds who took it (host, pid, SLURM job, start time, command) as JSON, so a refused job
can name the holder. The holder removes the file when it
ends normally (while still holding the lock; a job that opened the old file notices and tries
again); a killed holder leaves it behind, unlocked, and the next job simply takes it. It is not
part of the run.

POSIX locks work on local file systems and on NFS (v3 through lockd, v4 natively); on Lustre they
need the client's ``flock`` mount option, on some FUSE file systems not at all. Where the file system
refuses locking (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``, ``EINVAL``), :func:`lock_run_dir` prints one
warning line and goes on unlocked: two jobs on that directory are then not detected.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from hpcgnn.errors import InputError
from hpcgnn.fileio import write_error

LOCK_FILE = ".hpcgnn.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_HELD = {errno.EACCES, errno.EAGAIN}


def holder_text(info: dict) -> str:
    """``host H, pid P, SLURM job J, since T`` from a lock file's JSON (missing fields left out)."""
    parts = [f"host {info['host']}" if info.get("host") else "",
             f"pid {info['pid']}" if info.get("pid") else "",
             f"SLURM job {info['slurm_job']}" if info.get("slurm_job") else "",
             f"since {info['since']}" if info.get("since") else ""]
    return ", ".join(p for p in parts if p) or "holder unknown"


class RunLock:
    """An exclusive lock on one run directory, held by this process until :meth:`release`
    (or its end). ``locked`` is False where the file system does not support locking."""

    def __init__(self, run_dir: Path, fd: int | None, locked: bool):
        self.run_dir = run_dir
        self._fd = fd
        self.locked = locked

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    def release(self) -> None:
        """Remove the lock file and drop the lock (closing the file drops the process's POSIX
        locks on it). The file is removed while still locked: a job that opened it meanwhile
        finds, once it holds the lock, that the path names another file, and tries again."""
        if self._fd is not None:
            if self.locked:
                try:
                    if _same_file(self._fd, self.path):
                        os.unlink(self.path)
                except OSError:
                    pass
            os.close(self._fd)
            self._fd = None
            self.locked = False


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_run_dir(run_dir: str | os.PathLike, purpose: str = "train") -> RunLock:
    """Take ``RUN/.hpcgnn.lock`` without waiting (the directory must exist).

    InputError naming the holder when another live process holds it, or naming the path and the
    OS reason when the lock file cannot be created (an unwritable or full directory)."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    for _ in range(10):   # the holder may remove the file between our open and our lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:   # the lock file is the first thing a job creates there
            raise write_error(run_dir, exc, "run directory is not writable") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _HELD:
                try:
                    info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
                except (OSError, ValueError):
                    info = {}
                os.close(fd)
                raise InputError(f"{run_dir}: run directory is in use by another job "
                                 f"({holder_text(info)}"
                                 f"{', ' + info['command'] if info.get('command') else ''}); wait for "
                                 "it to end or stop it, or use another output.dir") from None
            os.close(fd)
            if exc.errno in _UNSUPPORTED:
                print(f"hpcgnn: warning: {run_dir}: the file system does not support locking "
                      f"({errno.errorcode.get(exc.errno, exc.errno)}): a second job on this run "
                      "directory will not be detected", file=sys.stderr, flush=True)
                return RunLock(run_dir, None, False)
            raise write_error(run_dir, exc, "cannot lock the run directory") from None
        if _same_file(fd, path):
            break
        os.close(fd)
    else:
        raise InputError(f"{run_dir}: cannot lock the run directory (its lock file keeps changing)")
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "command": f"hpcgnn {purpose}",
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:
        pass   # the holder's description is a courtesy; the lock is what counts
    return RunLock(run_dir, fd, True)
