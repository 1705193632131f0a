"""Atomic file and directory output, and one-line errors for unreadable inputs.

Writers never leave a half-written result: they write to a temporary name in
the destination's directory and rename it into place only on success.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
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
    text = getattr(exc, "strerror", None) or (os.strerror(code) if code else str(exc))
    name = errno.errorcode.get(code) if code else None
    return f"{text} ({name})" if name else text


def write_error(path: str | os.PathLike, exc: OSError, what: str = "cannot write") -> InputError:
    """The one-line error for an output that could not be written: ``PATH: cannot write
    (No space left on device (ENOSPC))``."""
    return InputError(f"{path}: {what} ({os_reason(exc)})")


def check_writable_dir(directory: str | os.PathLike, what: str = "output directory") -> Path:
    """Refuse (InputError naming ``directory`` and the OS reason) a directory this process
    cannot create files in: a probe file is created and removed, so permissions, read-only
    mounts and a full file system (where creating a file fails) are all caught before any
    work starts."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: {what} does not exist or is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpcgnn-probe.", suffix=".tmp", dir=directory)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; rename it to ``path`` on success."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary directory beside ``path``; swap it in for ``path`` on success.

    An existing ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the usual mode
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
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
