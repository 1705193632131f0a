"""Write Planetoid-layout directories (Python-2 style pickles with scipy csr_matrix) without scipy."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def csr_pickle(dense: np.ndarray) -> bytes:
    """Pickle bytes that unpickle (with scipy) to scipy.sparse.csr.csr_matrix(dense)."""
    nz = dense != 0
    state = {
        "format": "csr",
        "_shape": tuple(int(s) for s in dense.shape),
        "indptr": np.concatenate(([0], np.cumsum(nz.sum(axis=1)))).astype(np.int32),
        "indices": np.nonzero(nz)[1].astype(np.int32),
        "data": dense[nz].astype(np.float32),
        "maxprint": 50,
    }
    body = pickle.dumps(state, protocol=2)[2:-1]  # strip PROTO and STOP
    return b"\x80\x02" + b"cscipy.sparse.csr\ncsr_matrix\n" + b")\x81" + body + b"b."


def write_planetoid(directory: Path, name: str, allx, ally, num_train: int, tx, ty, test_index, graph: dict):
    """ind.<name>.* files; x/y are the first ``num_train`` rows of allx/ally."""
    directory.mkdir(parents=True, exist_ok=True)
    p = lambda part: directory / f"ind.{name}.{part}"  # noqa: E731
    p("x").write_bytes(csr_pickle(allx[:num_train]))
    p("allx").write_bytes(csr_pickle(allx))
    p("tx").write_bytes(csr_pickle(tx))
    for part, a in (("y", ally[:num_train]), ("ally", ally), ("ty", ty)):
        p(part).write_bytes(pickle.dumps(np.asarray(a), protocol=2))
    from collections import defaultdict

    g = defaultdict(list)
    g.update({k: list(v) for k, v in graph.items()})
    p("graph").write_bytes(pickle.dumps(g, protocol=2))
    p("test.index").write_text("".join(f"{int(i)}\n" for i in test_index))
    return directory
