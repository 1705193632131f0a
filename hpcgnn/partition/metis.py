"""Multi-constraint METIS k-way partitioning through ctypes, on the leanest METIS build installed.

pymetis 2025.2.2 ignores multi-constraint vertex weights (docs: /work/shared/notes/platform.md),
so ``METIS_PartGraphKway`` is called directly through ctypes, on one of two builds of the
METIS 5 API:

* ``cmeel-metis`` (a PyPI wheel: METIS 5.2.1 with 32-bit ``idx_t``, its GKlib from
  ``cmeel-gklib``), preferred: METIS' memory is mostly arrays of ``idx_t``, so it needs half
  the memory, and METIS 5.2 can keep its coarsened graphs on disk (``ondisk``);
* the METIS 5.1.0 linked into pymetis' own extension module (``pymetis._internal``, 64-bit
  ``idx_t``), the fallback when cmeel-metis is not installed or a graph is too large for
  32-bit indices.

Where the memory goes: METIS keeps every coarsening level until it projects the partition
back, each as ``adjncy`` + ``adjwgt`` (2 ``idx_t`` per directed edge) plus a few per-vertex
arrays. A graph that coarsens poorly keeps most of its edges at every level: the
products-like graph keeps 90-97 % of the edges from one level to the next, so the 7 levels
hold 6.3x the input's edges, about 115 bytes per input edge with 64-bit ``idx_t`` and half
that with 32-bit. With ``ondisk`` METIS 5.2 writes each level of 128 MiB or more to a file
once the next coarser one exists, and reads it back on the way up: about two levels are in
memory at a time. The files go to a private directory under the given path (METIS names
them ``metis<pid>.<n>`` in the current directory, so the call changes the process's working
directory while METIS runs).

Option indices are read from the library's own definitions (``metis.h`` shipped in the wheel,
``pymetis._internal.OptionKey``), and a tiny probe graph checks the ABI before first use.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

METIS_OK = 1
METIS_STATUS = {-2: "METIS_ERROR_INPUT (erroneous inputs or options)",
                -3: "METIS_ERROR_MEMORY (out of memory)", -4: "METIS_ERROR"}
METIS_OBJTYPE_CUT = 0
# Refinement passes per uncoarsening level. METIS' own default is 10; 3 is chosen here because
# refinement converges within 2-3 passes on graphs with structure (products-like, Cora: edge cut
# identical or within 0.5 % of niter=10) while on the random-graph worst case niter=3 takes about
# half the time of niter=10 for a 2-3 % larger cut (measurements in docs/benchmarks.md).
DEFAULT_NITER = 3
LIBRARIES = ("cmeel-metis", "pymetis")
INT32_LIMIT = 2**31 - 1
# Peak memory model of `partition --method metis` (docs/benchmarks.md): bytes per directed edge by
# idx_t width and whether the coarsened levels go to disk (products-like, 123M directed edges:
# 2.66 GiB with cmeel-metis on disk, 8.3 GiB in memory; 64-bit idx_t doubles the in-memory
# figure), plus the per-vertex arrays (row pointer, weights, assignment, renumbering).
BYTES_PER_EDGE = {(4, True): 22, (4, False): 72, (8, False): 144, (8, True): 44}
BYTES_PER_VERTEX = 120


@dataclass(frozen=True)
class MetisLibrary:
    """One loaded METIS build: its ctypes handle, ``idx_t`` width and option indices."""

    name: str                  # "cmeel-metis" or "pymetis"
    package_version: str       # version of the Python package that ships it
    metis_version: str         # e.g. "5.2.1"
    idx_dtype: np.dtype        # int32 or int64
    noptions: int
    option_index: dict = field(hash=False, compare=False)
    lib: ctypes.CDLL = field(hash=False, compare=False, repr=False)
    real_dtype: np.dtype = field(default=np.dtype(np.float32), compare=False)  # real_t (tpwgts)

    def describe(self) -> str:
        return (f"METIS {self.metis_version} from {self.name} {self.package_version} "
                f"(idx_t {np.dtype(self.idx_dtype).name})")

    @property
    def supports_ondisk(self) -> bool:
        return "ONDISK" in self.option_index

    def fits(self, num_nodes: int, num_edges: int, ncon: int = 1, max_weight_total: int = 0) -> bool:
        """Whether a graph of this size (and per-constraint weight totals) fits ``idx_t``."""
        if np.dtype(self.idx_dtype).itemsize >= 8:
            return True
        return max(num_nodes * max(ncon, 1), num_edges, max_weight_total) < INT32_LIMIT


def memory_bytes(num_nodes: int, num_edges: int, idx_bytes: int, ondisk: bool) -> int:
    """Modelled peak bytes of partitioning a graph of ``num_edges`` directed edges with a METIS
    build of ``idx_bytes``-byte ``idx_t`` (4 or 8), its coarsened levels on disk or not."""
    return int(BYTES_PER_EDGE[(int(idx_bytes), bool(ondisk))] * num_edges + BYTES_PER_VERTEX * num_nodes)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    try:
        fn = lib.METIS_PartGraphKway
        setdef = lib.METIS_SetDefaultOptions
    except AttributeError as exc:  # pragma: no cover - only with a different build
        raise RuntimeError(f"{lib._name} does not export the METIS 5 API ({exc})") from None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 13
    setdef.restype = ctypes.c_int
    setdef.argtypes = [ctypes.c_void_p]
    return lib


def _real_width(text: str) -> int:
    """REALTYPEWIDTH of a metis.h (32 when it does not say)."""
    m = re.search(r"^\s*#define\s+REALTYPEWIDTH\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else 32


def _header_facts(text: str) -> tuple[int, str, int, dict]:
    """(IDXTYPEWIDTH, version, METIS_NOPTIONS, {option name: index}) from a metis.h."""
    width = re.search(r"^\s*#define\s+IDXTYPEWIDTH\s+(\d+)", text, re.M)
    ver = [re.search(rf"^\s*#define\s+METIS_VER_{part}\s+(\d+)", text, re.M)
           for part in ("MAJOR", "MINOR", "SUBMINOR")]
    nopt = re.search(r"^\s*#define\s+METIS_NOPTIONS\s+(\d+)", text, re.M)
    enum = re.search(r"typedef\s+enum\s*\{(.*?)\}\s*moptions_et\s*;", text, re.S)
    if width is None or nopt is None or enum is None or not all(ver):
        raise RuntimeError("metis.h lacks IDXTYPEWIDTH, METIS_VER_*, METIS_NOPTIONS or moptions_et")
    names = re.findall(r"METIS_OPTION_(\w+)", re.sub(r"/\*.*?\*/", "", enum.group(1), flags=re.S))
    return (int(width.group(1)), ".".join(m.group(1) for m in ver), int(nopt.group(1)),
            {name: i for i, name in enumerate(names)})


def _load_cmeel() -> MetisLibrary:
    from importlib import metadata

    try:
        dist = metadata.distribution("cmeel-metis")
    except metadata.PackageNotFoundError:
        raise RuntimeError("cmeel-metis is not installed (pip install cmeel-metis)") from None
    prefix = Path(dist.locate_file("cmeel.prefix"))
    lib_path = next((p for p in sorted((prefix / "lib").glob("libmetis.*")) if p.suffix in (".so", ".dylib")), None)
    header = prefix / "include" / "metis.h"
    if lib_path is None or not header.is_file():
        raise RuntimeError(f"cmeel-metis is installed but {prefix} holds no libmetis or metis.h")
    width, version, noptions, options = _header_facts(header.read_text())
    # libmetis needs libGKlib (cmeel-gklib); its RUNPATH does not find it, so load it first, globally.
    for gk in sorted((prefix / "lib").glob("libGKlib.*")):
        ctypes.CDLL(str(gk), mode=ctypes.RTLD_GLOBAL)
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as exc:
        raise RuntimeError(f"cannot load {lib_path} ({exc}); is cmeel-gklib installed?") from None
    if width not in (32, 64):
        raise RuntimeError(f"{header}: IDXTYPEWIDTH {width}")
    real = _real_width(header.read_text())
    if real not in (32, 64):
        raise RuntimeError(f"{header}: REALTYPEWIDTH {real}")
    return MetisLibrary("cmeel-metis", dist.version, version, np.dtype(f"int{width}"), noptions, options,
                        _bind(lib), np.dtype(f"float{real}"))


def _load_pymetis() -> MetisLibrary:
    import pymetis
    import pymetis._internal as internal

    keys = internal.OptionKey
    options = {name: int(getattr(keys, name)) for name in dir(keys)
               if name.isupper() and isinstance(getattr(keys, name), int)}
    return MetisLibrary("pymetis", str(pymetis.version), "5.1.0", np.dtype(np.int64), 40, options,
                        _bind(ctypes.CDLL(internal.__file__)))


@functools.lru_cache(maxsize=None)
def load_library(name: str = "auto") -> MetisLibrary:
    """The METIS build ``name`` ("cmeel-metis", "pymetis"), or for "auto" the first of them that
    loads and passes the probe. Raises RuntimeError if the named one is unusable."""
    if name not in ("auto", *LIBRARIES):
        raise ValueError(f"unknown METIS library {name!r}, expected auto or one of {', '.join(LIBRARIES)}")
    errors = []
    for candidate in (LIBRARIES if name == "auto" else (name,)):
        try:
            library = _load_cmeel() if candidate == "cmeel-metis" else _load_pymetis()
            _probe(library)
            return library
        except (RuntimeError, OSError, ImportError) as exc:
            errors.append(f"{candidate}: {exc}")
    raise RuntimeError("no usable METIS library (" + "; ".join(errors) + ")")


def choose_library(name: str, num_nodes: int, num_edges: int, ncon: int = 3) -> MetisLibrary:
    """The library to partition a graph of this size with: ``name`` if it fits, and for "auto"
    the int32 build when the graph fits 32-bit indices, else the int64 one.
    Raises RuntimeError when nothing fits or loads."""
    # The "edges" constraint's total is num_edges; every other total is at most num_nodes.
    if name != "auto":
        library = load_library(name)
        if not library.fits(num_nodes, num_edges, ncon, num_edges):
            raise RuntimeError(f"{library.describe()} cannot index a graph of {num_nodes} vertices and "
                               f"{num_edges} edges; use pymetis (64-bit)")
        return library
    for candidate in LIBRARIES:
        try:
            library = load_library(candidate)
        except RuntimeError:
            continue
        if library.fits(num_nodes, num_edges, ncon, num_edges):
            return library
    return load_library("pymetis")


def metis_version() -> str:
    """A description of the METIS build that :func:`part_graph_kway` uses by default."""
    try:
        return load_library("auto").describe()
    except RuntimeError as exc:  # pragma: no cover - only on a broken install
        return f"unavailable ({exc})"


def _ptr(a: np.ndarray | None):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _call(library: MetisLibrary, indptr, indices, vwgt, nparts, seed, ufactor, niter=DEFAULT_NITER,
          ondisk: bool = False, tpwgts=None):
    idx = library.idx_dtype
    n = indptr.shape[0] - 1
    ncon = 1 if vwgt is None else vwgt.shape[1]
    key = library.option_index
    options = np.full(library.noptions, -1, dtype=idx)
    library.lib.METIS_SetDefaultOptions(_ptr(options))
    options[key["OBJTYPE"]] = METIS_OBJTYPE_CUT
    options[key["SEED"]] = seed
    options[key["UFACTOR"]] = ufactor
    options[key["NITER"]] = niter
    options[key["NUMBERING"]] = 0
    if ondisk:
        options[key["ONDISK"]] = 1
    nvtxs = np.array([n], dtype=idx)
    ncon_a = np.array([ncon], dtype=idx)
    nparts_a = np.array([nparts], dtype=idx)
    edgecut = np.zeros(1, dtype=idx)
    part = np.zeros(n, dtype=idx)
    rc = library.lib.METIS_PartGraphKway(_ptr(nvtxs), _ptr(ncon_a), _ptr(indptr), _ptr(indices), _ptr(vwgt),
                                         None, None, _ptr(nparts_a), _ptr(tpwgts), None, _ptr(options),
                                         _ptr(edgecut), _ptr(part))
    return rc, part, int(edgecut[0])


def _probe(library: MetisLibrary) -> None:
    """Partition two 4-cliques joined by one edge; anything but a cut of 1 means an ABI mismatch."""
    src = [0, 0, 0, 1, 1, 2, 4, 4, 4, 5, 5, 6, 3]
    dst = [1, 2, 3, 2, 3, 3, 5, 6, 7, 6, 7, 7, 4]
    s = np.array(src + dst, dtype=np.int64)
    d = np.array(dst + src, dtype=np.int64)
    order = np.lexsort((s, d))
    indptr = np.zeros(9, dtype=library.idx_dtype)
    np.cumsum(np.bincount(d, minlength=8), out=indptr[1:])
    indices = np.ascontiguousarray(s[order], dtype=library.idx_dtype)
    vwgt = np.ones((8, 2), dtype=library.idx_dtype)
    for key in ("OBJTYPE", "SEED", "UFACTOR", "NITER", "NUMBERING"):
        if key not in library.option_index:
            raise RuntimeError(f"{library.describe()}: no METIS_OPTION_{key}")
    rc, part, cut = _call(library, indptr, indices, vwgt, 2, 0, 30)
    if rc != METIS_OK or cut != 1 or sorted(np.bincount(part, minlength=2)) != [4, 4]:
        raise RuntimeError(f"{library.describe()} failed its self-test (rc={rc}, cut={cut}); "
                           "its idx_t or API differs from what its headers say")
    # Target weights 1/4, 3/4 of both constraints: a 2 / 6 split checks real_t's width.
    tp = np.ascontiguousarray(np.array([[0.25, 0.25], [0.75, 0.75]]), dtype=library.real_dtype)
    rc, part, _ = _call(library, indptr, indices, vwgt, 2, 0, 30, tpwgts=tp)
    if rc != METIS_OK or np.bincount(part, minlength=2).tolist() != [2, 6]:
        raise RuntimeError(f"{library.describe()} failed its target-weight self-test (rc={rc}, sizes "
                           f"{np.bincount(part, minlength=2).tolist()}); its real_t differs from "
                           f"{np.dtype(library.real_dtype).name}")


@dataclass
class _Cwd:
    """Run a block in another working directory, then return (by descriptor: robust to renames)."""

    path: Path

    def __enter__(self):
        self._fd = os.open(".", os.O_RDONLY)
        os.chdir(self.path)

    def __exit__(self, *exc):
        try:
            os.fchdir(self._fd)
        finally:
            os.close(self._fd)


def part_graph_kway(indptr: np.ndarray, indices: np.ndarray, nparts: int,
                    vwgt: np.ndarray | None = None, seed: int = 0, ufactor: int = 30,
                    niter: int = DEFAULT_NITER, *, library: MetisLibrary | None = None,
                    ondisk: str | os.PathLike | None = None,
                    tpwgts: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Min-edge-cut k-way partition of a symmetric CSR graph without self-loops.

    ``vwgt`` is a C-contiguous integer array [N, ncon] of vertex weights (one balance constraint
    per column; None = unit weights). ``ufactor`` is the allowed imbalance in thousandths
    (30 = 1.03 per constraint); ``niter`` the refinement passes per level (METIS_OPTION_NITER,
    >= 1; more passes cost time and can lower the cut). ``library`` is the METIS build
    (default: :func:`load_library` "auto"); arrays not already of its ``idx_t`` dtype are
    copied, so pass them in that dtype to save memory. ``ondisk``: a directory in which METIS
    keeps its coarsened graphs while it does not need them (METIS 5.2 builds only; a private
    subdirectory is made and removed). ``tpwgts``: target fraction of every constraint's total
    weight for each part, float [nparts, ncon] (columns sum to 1; METIS ``tpwgts``); None = equal
    parts, exactly as METIS' own default. Returns (part int64 [N] in [0, nparts), METIS' edge cut).
    Raises RuntimeError if METIS reports an error.
    """
    library = library or load_library("auto")
    idx = library.idx_dtype
    n = indptr.shape[0] - 1
    if niter < 1:
        raise ValueError(f"niter={niter}: expected >= 1")
    if not 1 <= nparts <= max(n, 1):
        raise ValueError(f"nparts={nparts} outside [1, {n}]")
    if vwgt is not None:
        if vwgt.ndim != 2 or vwgt.shape[0] != n or vwgt.shape[1] < 1:
            raise ValueError(f"vwgt has shape {vwgt.shape}, expected ({n}, ncon)")
    ncon = 1 if vwgt is None else vwgt.shape[1]
    total = int(vwgt.sum(axis=0).max()) if vwgt is not None and n else 0
    if not library.fits(n, int(indices.shape[0]), ncon, total):
        raise ValueError(f"{library.describe()} cannot index this graph ({n} vertices, {indices.shape[0]} edges)")
    if ondisk is not None and not library.supports_ondisk:
        raise ValueError(f"{library.describe()} cannot keep its coarsened graphs on disk")
    if tpwgts is not None:
        tpwgts = np.ascontiguousarray(tpwgts, dtype=library.real_dtype)
        if tpwgts.shape != (nparts, ncon) or not np.all(tpwgts > 0) or \
                not np.allclose(tpwgts.sum(axis=0, dtype=np.float64), 1.0, atol=1e-4):
            raise ValueError(f"tpwgts has shape {tpwgts.shape} or values outside (0, 1] not summing to 1 "
                             f"per constraint, expected ({nparts}, {ncon})")
    indptr = np.ascontiguousarray(indptr, dtype=idx)
    indices = np.ascontiguousarray(indices, dtype=idx)
    if vwgt is not None:
        vwgt = np.ascontiguousarray(vwgt, dtype=idx)
    if ondisk is None:
        rc, part, cut = _call(library, indptr, indices, vwgt, int(nparts), int(seed), int(ufactor), int(niter),
                              tpwgts=tpwgts)
    else:
        scratch = Path(tempfile.mkdtemp(prefix=".hpcgnn-metis.", dir=ondisk))
        try:
            with _Cwd(scratch):
                rc, part, cut = _call(library, indptr, indices, vwgt, int(nparts), int(seed), int(ufactor),
                                      int(niter), ondisk=True, tpwgts=tpwgts)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if rc != METIS_OK:
        raise RuntimeError(f"METIS_PartGraphKway returned {rc}: {METIS_STATUS.get(rc, 'unknown status')}")
    if n and (part.min() < 0 or part.max() >= nparts):
        raise RuntimeError("METIS_PartGraphKway returned partition IDs out of range")
    return part.astype(np.int64, copy=False), cut
