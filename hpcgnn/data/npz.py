"""Arrays of an .npz archive read in blocks, never whole.

An .npz is a zip archive of .npy files (``np.savez`` stores them, ``np.savez_compressed``
deflates them). :class:`NpzArchive` opens one and lists its members' .npy headers;
:meth:`NpyMember.blocks` yields a member's elements in file order, ``count`` at a time:

* a stored member is read straight from the archive file at its data offset (the zip local
  header's end plus the .npy header), one block per read, so nothing but the block is resident;
* a deflated member is decompressed as a stream through :mod:`zipfile` after its .npy header
  (a start offset is reached by decompressing and dropping what precedes it).

Any failure to read (a truncated or corrupt archive, a member shorter than its header says, a
CRC mismatch) is an InputError naming the archive and the member.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")   # zip local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


class NpyMember:
    """One .npy member of an archive: ``name`` (without .npy), ``shape``, ``dtype``,
    ``fortran_order``, ``stored`` (not compressed) and, when stored, ``data_offset`` in the file."""

    def __init__(self, archive: "NpzArchive", info: zipfile.ZipInfo):
        self.archive, self.info = archive, info
        self.name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        self.stored = info.compress_type == zipfile.ZIP_STORED
        with archive.guard(self.name):
            with archive.zip.open(info) as fh:
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
                self.header_bytes = fh.tell()
        if dtype.hasobject:
            raise InputError(f"{archive.path}: member '{self.name}' holds Python objects, expected a numeric array")
        self.shape, self.dtype, self.fortran_order = tuple(int(s) for s in shape), np.dtype(dtype), bool(fortran)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        self.data_offset = None
        if self.stored:
            self.data_offset = self._local_data_start() + self.header_bytes
            end = self.data_offset + self.size * self.dtype.itemsize
            if end > archive.file_size:
                raise InputError(f"{archive.path}: member '{self.name}' ends at byte {end:,} but the file has "
                                 f"{archive.file_size:,} (truncated archive)")

    def _local_data_start(self) -> int:
        """Offset of the member's data: after its local header, name and extra field."""
        with open(self.archive.path, "rb") as fh:
            fh.seek(self.info.header_offset)
            raw = fh.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
            raise InputError(f"{self.archive.path}: member '{self.name}' has no zip local header at byte "
                             f"{self.info.header_offset:,} (corrupt archive)")
        fields = _LOCAL_HEADER.unpack(raw)
        return self.info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]

    def blocks(self, start: int = 0, count: int | None = None, block: int = 1 << 22):
        """Yield elements ``[start, start + count)`` (in file order: C order, or Fortran order
        when ``fortran_order``) as 1-D arrays of at most ``block`` elements."""
        count = self.size - start if count is None else int(count)
        if start < 0 or count < 0 or start + count > self.size:
            raise ValueError(f"elements [{start}, {start + count}) outside [0, {self.size})")
        item = self.dtype.itemsize
        block = max(1, int(block))
        with self.archive.guard(self.name):
            if self.stored:
                with open(self.archive.path, "rb") as fh:
                    fh.seek(self.data_offset + start * item)
                    for lo in range(0, count, block):
                        k = min(block, count - lo)
                        out = np.fromfile(fh, dtype=self.dtype, count=k)
                        if out.shape[0] != k:
                            raise EOFError("short read")
                        yield out
                return
            with self.archive.zip.open(self.info) as fh:
                fh.seek(self.header_bytes + start * item)
                for lo in range(0, count, block):
                    k = min(block, count - lo)
                    raw = fh.read(k * item)
                    if len(raw) != k * item:
                        raise EOFError("short read")
                    yield np.frombuffer(raw, dtype=self.dtype)
                if start + count == self.size:
                    fh.read()       # to the end, so that zipfile checks the CRC


class NpzArchive:
    """An open .npz archive: ``members`` maps each array name to its :class:`NpyMember`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: file not found")
        self.file_size = self.path.stat().st_size
        try:
            self.zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise InputError(f"{self.path}: not a readable .npz archive ({_reason(exc)}; truncated or corrupt?)") \
                from None
        try:
            self.members = {m.name: m for m in (NpyMember(self, info) for info in self.zip.infolist()
                                                if not info.is_dir())}
        except BaseException:
            self.zip.close()
            raise

    def guard(self, member: str):
        return _Guard(self.path, member)

    def __enter__(self) -> "NpzArchive":
        return self

    def __exit__(self, *exc) -> None:
        self.zip.close()

    def member(self, name: str, ndim: int | None = None) -> NpyMember:
        """Member ``name``; InputError naming the archive when it is missing or has another ndim."""
        if name not in self.members:
            raise InputError(f"{self.path}: array '{name}' not found (archive has {sorted(self.members)})")
        m = self.members[name]
        if ndim is not None and len(m.shape) != ndim:
            raise InputError(f"{self.path}: array '{name}' has shape {m.shape}, expected {ndim} dimensions")
        return m

    def read(self, name: str) -> np.ndarray:
        """A small member whole (counts, lists)."""
        m = self.member(name)
        parts = list(m.blocks())
        flat = np.concatenate(parts) if parts else np.empty(0, m.dtype)
        return flat.reshape(m.shape, order="F" if m.fortran_order else "C")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0]}" if text else exc.__class__.__name__


class _Guard:
    """Turns the failures of reading a member into one InputError naming archive and member."""

    def __init__(self, path: Path, member: str):
        self.path, self.member = path, member

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (InputError, GeneratorExit)):
            return False
        if isinstance(exc, (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError)):
            raise InputError(f"{self.path}: member '{self.member}' cannot be read ({_reason(exc)}; truncated "
                             "or corrupt archive?)") from None
        return False
