"""Multi-constraint METIS k-way partitioning through ctypes.

pymetis 2025.2.2 ignores multi-constraint vertex weights (docs: /work/shared/notes/platform.md),
so ``METIS_PartGraphKway`` is called directly on the METIS library linked into pymetis' own
extension module (``pymetis._internal``). That METIS uses 64-bit ``idx_t``; option indices are
read from ``pymetis._internal.OptionKey`` (compiled from the same ``metis.h``), and a tiny probe
graph checks the ABI before every real call.
"""
from __future__ import annotations

import ctypes

import numpy as np

METIS_NOPTIONS = 40
METIS_OK = 1
METIS_STATUS = {-2: "METIS_ERROR_INPUT (erroneous inputs or options)",
                -3: "METIS_ERROR_MEMORY (out of memory)", -4: "METIS_ERROR"}
METIS_OBJTYPE_CUT = 0
# Refinement passes per uncoarsening level. METIS' own default is 10; 3 is chosen here because
# refinement converges within 2-3 passes on graphs with structure (products-like, Cora: edge cut
# identical or within 0.5 % of niter=10) while on the random-graph worst case niter=3 takes about
# half the time of niter=10 for a 2-3 % larger cut (measurements in docs/benchmarks.md).
DEFAULT_NITER = 3


def _library():
    """(ctypes library, OptionKey) of the METIS inside pymetis."""
    import pymetis._internal as internal

    lib = ctypes.CDLL(internal.__file__)
    try:
        fn = lib.METIS_PartGraphKway
        lib.METIS_SetDefaultOptions
    except AttributeError as exc:  # pragma: no cover - only with a different pymetis build
        raise RuntimeError(f"{internal.__file__} does not export METIS_PartGraphKway ({exc})") from None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 13
    lib.METIS_SetDefaultOptions.restype = ctypes.c_int
    lib.METIS_SetDefaultOptions.argtypes = [ctypes.c_void_p]
    return lib, internal.OptionKey


def metis_version() -> str:
    """A description of the METIS build that :func:`part_graph_kway` calls."""
    import pymetis

    return f"METIS 5.1 API bundled in pymetis {pymetis.version} (idx_t int64)"


def _ptr(a: np.ndarray | None):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _call(lib, keys, indptr, indices, vwgt, nparts, seed, ufactor, niter=DEFAULT_NITER):
    n = indptr.shape[0] - 1
    ncon = 1 if vwgt is None else vwgt.shape[1]
    options = np.full(METIS_NOPTIONS, -1, dtype=np.int64)
    lib.METIS_SetDefaultOptions(_ptr(options))
    options[int(keys.OBJTYPE)] = METIS_OBJTYPE_CUT
    options[int(keys.SEED)] = seed
    options[int(keys.UFACTOR)] = ufactor
    options[int(keys.NITER)] = niter
    options[int(keys.NUMBERING)] = 0
    nvtxs = np.array([n], dtype=np.int64)
    ncon_a = np.array([ncon], dtype=np.int64)
    nparts_a = np.array([nparts], dtype=np.int64)
    edgecut = np.zeros(1, dtype=np.int64)
    part = np.zeros(n, dtype=np.int64)
    rc = lib.METIS_PartGraphKway(_ptr(nvtxs), _ptr(ncon_a), _ptr(indptr), _ptr(indices), _ptr(vwgt),
                                 None, None, _ptr(nparts_a), None, None, _ptr(options),
                                 _ptr(edgecut), _ptr(part))
    return rc, part, int(edgecut[0])


def _probe(lib, keys) -> None:
    """Partition two 4-cliques joined by one edge; anything but a cut of 1 means an ABI mismatch."""
    src = [0, 0, 0, 1, 1, 2, 4, 4, 4, 5, 5, 6, 3]
    dst = [1, 2, 3, 2, 3, 3, 5, 6, 7, 6, 7, 7, 4]
    s = np.array(src + dst, dtype=np.int64)
    d = np.array(dst + src, dtype=np.int64)
    order = np.lexsort((s, d))
    indptr = np.zeros(9, dtype=np.int64)
    np.cumsum(np.bincount(d, minlength=8), out=indptr[1:])
    indices = np.ascontiguousarray(s[order])
    vwgt = np.ones((8, 2), dtype=np.int64)
    rc, part, cut = _call(lib, keys, indptr, indices, vwgt, 2, 0, 30)
    if rc != METIS_OK or cut != 1 or sorted(np.bincount(part, minlength=2)) != [4, 4]:
        raise RuntimeError(f"METIS in pymetis failed its self-test (rc={rc}, cut={cut}); "
                           "the library's idx_t is not int64 or the API differs from METIS 5.1")


def part_graph_kway(indptr: np.ndarray, indices: np.ndarray, nparts: int,
                    vwgt: np.ndarray | None = None, seed: int = 0, ufactor: int = 30,
                    niter: int = DEFAULT_NITER) -> tuple[np.ndarray, int]:
    """Min-edge-cut k-way partition of a symmetric CSR graph without self-loops.

    ``vwgt`` is a C-contiguous int64 array [N, ncon] of vertex weights (one balance constraint
    per column; None = unit weights). ``ufactor`` is the allowed imbalance in thousandths
    (30 = 1.03 per constraint); ``niter`` the refinement passes per level (METIS_OPTION_NITER,
    >= 1; more passes cost time and can lower the cut). Returns (part int64 [N] in [0, nparts), METIS' edge cut).
    Raises RuntimeError if METIS reports an error.
    """
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    n = indptr.shape[0] - 1
    if vwgt is not None:
        vwgt = np.ascontiguousarray(vwgt, dtype=np.int64)
        if vwgt.ndim != 2 or vwgt.shape[0] != n or vwgt.shape[1] < 1:
            raise ValueError(f"vwgt has shape {vwgt.shape}, expected ({n}, ncon)")
    if niter < 1:
        raise ValueError(f"niter={niter}: expected >= 1")
    if not 1 <= nparts <= max(n, 1):
        raise ValueError(f"nparts={nparts} outside [1, {n}]")
    lib, keys = _library()
    _probe(lib, keys)
    rc, part, cut = _call(lib, keys, indptr, indices, vwgt, int(nparts), int(seed), int(ufactor),
                          int(niter))
    if rc != METIS_OK:
        raise RuntimeError(f"METIS_PartGraphKway returned {rc}: {METIS_STATUS.get(rc, 'unknown status')}")
    if n and (part.min() < 0 or part.max() >= nparts):
        raise RuntimeError("METIS_PartGraphKway returned partition IDs out of range")
    return part, cut
