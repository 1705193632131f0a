"""Atomic file and directory output, and one-line errors for unreadable inputs.

Writers never leave a half-written result: they write to a temporary name in
the destination's directory and rename it into place only on success.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import h5py

from hpcgnn.errors import InputError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def os_reason(exc: OSError) -> str:
    """The OS reason of ``exc`` in words with its errno name, e.g.
    ``No space left on device (ENOSPC)``; for messages that name the path themselves."""
    code = getattr(exc, "errno", None)
    # the C library's words for the errno: libraries such as h5py put their whole report in strerror
    text = os.strerror(code) if code else (getattr(exc, "strerror", None) or str(exc))
    name = errno.errorcode.get(code) if code else None
    return f"{text} ({name})" if name else text


def write_error(path: str | os.PathLike, exc: OSError, what: str = "cannot write") -> InputError:
    """The one-line error for an output that could not be written: ``PATH: cannot write
    (No space left on device (ENOSPC))``."""
    return InputError(f"{path}: {what} ({os_reason(exc)})")


def _probe(directory: Path, nbytes: int, sync: bool) -> None:
    """Create, write ``nbytes`` to (and with ``sync`` fsync) and remove a probe file in
    ``directory``; the OSError of whatever step fails."""
    fd, probe = tempfile.mkstemp(prefix=".hpcgnn-probe.", suffix=".tmp", dir=directory)
    try:
        os.write(fd, b"\0" * nbytes)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def write_failure(path: str | os.PathLike, exc: BaseException, what: str = "cannot write") -> InputError:
    """:func:`write_error` for any exception raised while writing ``path``: when ``exc`` carries
    no errno (h5py's and torch's writers often wrap the OS error), the directory is probed with
    a small write to find the OS reason (a full or read-only file system, lost permission); the
    exception's own first line is the last resort."""
    if isinstance(exc, OSError) and exc.errno:
        return write_error(path, exc, what)
    try:
        _probe(Path(path).parent, 65536, sync=True)
    except OSError as probe_exc:
        return write_error(path, probe_exc, what)
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return InputError(f"{path}: {what} ({exc.__class__.__name__}: {first})")


def check_writable_dir(directory: str | os.PathLike, what: str = "output directory") -> Path:
    """Refuse (InputError naming ``directory`` and the OS reason) a directory this process
    cannot create files in: a probe file is created and removed, so permissions, read-only
    mounts and a full file system (where creating a file fails) are all caught before any
    work starts."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: {what} does not exist or is not a directory")
    try:
        _probe(directory, 1, sync=False)
    except OSError as exc:
        raise write_error(directory, exc, f"{what} is not writable") from None
    return directory


def check_output(path: str | os.PathLike, force: bool) -> Path:
    """Refuse an existing output unless ``force``; return it as a Path."""
    path = Path(path)
    if path.exists() and not force:
        raise InputError(f"{path}: output already exists (pass --force to replace it)")
    if not path.parent.exists():
        raise InputError(f"{path}: parent directory {path.parent} does not exist")
    return path


# Temporaries of atomic_file/atomic_dir: ".NAME.<host>.<pid>.<12 hex>.tmp" (".old" for the
# replaced directory of atomic_dir). Before they recorded the writer they were mkstemp/mkdtemp
# names, ".NAME.<8 of [a-z0-9_]>.tmp|.old". Both shapes are unambiguous: another output's
# temporaries (".NAME.x.<...>") have more dot-separated parts after ".NAME.".
_TEMP_NEW = re.compile(r"([A-Za-z0-9-]+)\.([0-9]{1,10})\.[0-9a-f]{12}\.(?:tmp|old)")
_TEMP_OLD = re.compile(r"[a-z0-9_]{8}\.(?:tmp|old)")
_STALE_OTHER_HOST_S = 24 * 3600   # another host's temporary is stale after a day without writes


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """This host's name as it appears in temporary names: dots and other characters outside
    [A-Za-z0-9-] become '-', at most 32 characters."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname() or "localhost")[:32] or "localhost"


def new_temp(path: Path, suffix: str, directory: bool) -> Path:
    """Create (mode 0600 file or 0700 directory) and return a fresh temporary beside ``path``
    named after this writer: ``.NAME.<host>.<pid>.<random>SUFFIX``."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{_host()}.{os.getpid()}.{secrets.token_hex(6)}{suffix}"
        try:
            if directory:
                os.mkdir(tmp, 0o700)
            else:
                os.close(os.open(tmp, flags, 0o600))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", str(tmp))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's live process
        return True
    except (OverflowError, OSError):
        return False
    return True


def _started_after(pid: int, when: float) -> bool:
    """True when process ``pid`` certainly started after time ``when`` (Linux /proc; False
    where that cannot be told): then it is a reuse of the pid, not the writer of ``when``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return start > when + 2.0    # btime has 1 s resolution


def _last_write(entry: Path) -> float:
    """Newest mtime of ``entry`` and, for a directory, of its direct entries (no links followed)."""
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        with os.scandir(entry) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def _is_stale(entry: Path, rest: str, now: float) -> bool:
    """Whether the temporary ``entry`` (named ``.NAME.`` + ``rest``) was left by a writer that
    no longer runs: the old naming (no writer recorded: made before writers were recorded);
    this host's writer whose pid is gone (or now belongs to a process started after the
    temporary's last write); another host's writer only after _STALE_OTHER_HOST_S without a
    write, since its pid cannot be checked from here. Other names are not temporaries of NAME."""
    if _TEMP_OLD.fullmatch(rest):
        return True
    m = _TEMP_NEW.fullmatch(rest)
    if m is None:
        return False
    host, pid = m.group(1), int(m.group(2))
    if host != _host():
        return now - _last_write(entry) > _STALE_OTHER_HOST_S
    if pid == os.getpid() or _pid_alive(pid):
        return _started_after(pid, _last_write(entry))
    return True


def _remove_stale_temps(path: Path) -> list[str]:
    """Remove the temporaries of ``path`` that interrupted earlier writers left beside it (see
    :func:`_is_stale`; never another output's, never a live writer's) and say so in one line
    on stderr. Returns the names removed; a failure to list or remove is not an error here."""
    prefix, removed, now = f".{path.name}.", [], time.time()
    try:
        with os.scandir(path.parent) as it:
            candidates = [e.name for e in it if e.name.startswith(prefix)]
    except OSError:
        return []
    for name in sorted(candidates):
        entry = path.parent / name
        try:
            if not _is_stale(entry, name[len(prefix):], now):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue     # gone meanwhile (another writer cleaned it) or not ours to remove
        removed.append(name)
    if removed:
        many = len(removed) > 1
        print(f"hpcgnn: warning: removed {len(removed)} stale temporar{'ies' if many else 'y'} of "
              f"{'interrupted earlier writes' if many else 'an interrupted earlier write'} to {path}: "
              f"{', '.join(removed)}", file=sys.stderr, flush=True)
    return removed


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; rename it to ``path`` on success.

    The temporary is named after its writer, ``.NAME.<host>.<pid>.<random>.tmp``. Before it is
    made, the temporaries of ``path`` that killed writers left are removed, with one warning
    line on stderr (:func:`_remove_stale_temps`): this host's whose pid no longer runs (or runs
    a process started after the temporary's last write), those of the naming before writers
    were recorded (``.NAME.<random>.tmp``), and another host's after 24 h without a write (its
    pid cannot be checked from here). A live writer's and other outputs' temporaries are kept.
    """
    path = Path(path)
    _remove_stale_temps(path)
    tmp = new_temp(path, ".tmp", directory=False)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # created 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class _RecordingFile(io.RawIOBase):
    """The file object under :func:`atomic_h5`: plain unbuffered file I/O, except that the first
    OS error of a write is recorded (:attr:`error`) and that write and every later one report
    success without writing. HDF5 then never sees a failed write (after one, its close can leave
    the library in a state that crashes the process at exit), and the writer learns the OS
    reason with its errno instead of HDF5's own text."""

    def __init__(self, path: Path):
        super().__init__()
        self._f = open(path, "r+b", buffering=0)
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        return self._f.readinto(buffer)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self.error is None:
            try:
                done = 0
                while done < n:   # an unbuffered write may be partial
                    done += self._f.write(view[done:])
                return n
            except OSError as exc:
                self.error = exc
        self._f.seek(n, os.SEEK_CUR)
        return n

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as exc:
                self.error = exc
        return self._f.tell() if size is None else size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class H5Output:
    """What :func:`atomic_h5` yields: ``file`` (an :class:`h5py.File` open for writing) and
    :meth:`failure`."""

    def __init__(self, path: Path, file: h5py.File, sink: _RecordingFile):
        self.path, self.file, self._sink = path, file, sink

    def failure(self) -> InputError | None:
        """The one-line error of the first write the OS refused so far (``PATH: cannot write
        (No space left on device (ENOSPC))``), None while every write succeeded. HDF5 caches
        writes: a failure may show only when the file is closed (:func:`atomic_h5` checks then)."""
        return None if self._sink.error is None else write_error(self.path, self._sink.error)


@contextlib.contextmanager
def h5_writing(path: str | os.PathLike):
    """Create the HDF5 file ``path`` (replacing one there) and yield it open for writing through a
    file object that records the first write the OS refuses (:class:`_RecordingFile`): HDF5 never
    sees the failure, and that OSError (a full disk: errno ENOSPC) is raised when the block ends,
    after the file is closed. For files inside a temporary that the caller removes on error
    (:func:`atomic_dir`); :func:`atomic_h5` is the one-file form."""
    path = Path(path)
    path.open("wb").close()
    sink = _RecordingFile(path)
    try:
        f = h5py.File(sink, "w")
        try:
            yield f
        finally:
            f.close()
    finally:
        sink.close()
    if sink.error is not None:
        raise sink.error


@contextlib.contextmanager
def atomic_h5(path: str | os.PathLike):
    """Write the HDF5 file ``path`` atomically (:func:`atomic_file`): yields an :class:`H5Output`
    whose ``file`` is open for writing on the temporary; closed and renamed into place when the
    block ends. A write the OS refuses (a full disk, a quota, an I/O error), also one HDF5 makes
    while closing, raises :func:`write_error`'s InputError naming ``path`` and the OS reason,
    and the temporary is removed; so does an OSError creating the temporary."""
    path = Path(path)
    in_block = False
    try:
        with atomic_file(path) as tmp:
            sink = _RecordingFile(tmp)
            try:
                out = H5Output(path, h5py.File(sink, "w"), sink)
                try:
                    in_block = True
                    yield out
                    in_block = False
                finally:
                    out.file.close()
            finally:
                sink.close()
            failure = out.failure()
            if failure is not None:
                raise failure
    except OSError as exc:
        if in_block or not exc.errno:   # the caller's own error, or not the OS's
            raise
        raise write_error(path, exc) from None


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary directory beside ``path``; swap it in for ``path`` on success.

    An existing ``path`` is replaced only after the new one is complete. Temporaries are named
    and stale ones of ``path`` removed as in :func:`atomic_file` (``.NAME.<host>.<pid>.<random>.tmp``,
    and ``.old`` for the replaced directory on its way out).
    """
    path = Path(path)
    _remove_stale_temps(path)
    tmp = new_temp(path, ".tmp", directory=True)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # created 0700; give the usual mode
        if path.exists():
            old = new_temp(path, ".old", directory=True)
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def persist_and_drop_cache(path: str | os.PathLike) -> None:
    """Write ``path``'s data to disk (fdatasync) and drop its pages from the page cache.

    For large outputs that are not read back soon (partition files, graph files): the data
    is durable before the atomic rename, and the freed page-cache memory is reused by the
    next file instead of growing the cache. The latter matters on VMs where every new guest
    page costs a host fault: there, writing 1 GB into a growing page cache took 3-4 s of
    system time vs 0.8 s with this call after every 128 MB file (docs/benchmarks.md).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_h5(path: str | os.PathLike, expected_format: str | None = None) -> h5py.File:
    """Open an HDF5 file for reading, turning every failure into an InputError."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected an HDF5 file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: file is not readable (permission denied)")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise InputError(f"{path}: not a readable HDF5 file ({exc.__class__.__name__})") from None
    if expected_format is not None:
        got = f.attrs.get("format")
        if isinstance(got, bytes):
            got = got.decode()
        if got != expected_format:
            f.close()
            raise InputError(f"{path}: attribute 'format' is {got!r}, expected {expected_format!r}")
    return f


def read_dataset(f: h5py.File, name: str, dtype, shape: tuple | None = None):
    """Read dataset ``name`` checking its dtype kind and shape (None = any in that axis)."""
    import numpy as np

    where = f"{f.filename}: dataset '{name}'"
    if name not in f:
        raise InputError(f"{where} is missing")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise InputError(f"{where} is not a dataset")
    want = np.dtype(dtype)
    if ds.dtype.kind != want.kind and not (want.kind == "b" and ds.dtype.kind in "iu"):
        raise InputError(f"{where} has dtype {ds.dtype}, expected {want}")
    if shape is not None:
        if len(ds.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, ds.shape)):
            exp = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise InputError(f"{where} has shape {ds.shape}, expected {exp}")
    return np.asarray(ds[()], dtype=want)
