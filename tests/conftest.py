"""Shared fixtures: small graphs and their partition stores, built once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpiutil import ROOT  # noqa: E402

CORA_ROOT = ROOT / "inputs" / "data"


@pytest.fixture(scope="session")
def cora_graph(tmp_path_factory) -> Path:
    """Path of Cora imported with `hpcgnn prepare` (the shipped Planetoid files)."""
    from hpcgnn.cli import main

    out = tmp_path_factory.mktemp("cora") / "cora.h5"
    assert main(["prepare", "--dataset", "cora", "--root", str(CORA_ROOT), "--out", str(out)]) == 0
    return out


def _partition(graph: Path, parts: int, out: Path, method: str = "metis", seed: int = 0) -> Path:
    from hpcgnn.cli import main

    rc = main(["partition", str(graph), "--parts", str(parts), "--method", method,
               "--seed", str(seed), "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def cora_parts(cora_graph, tmp_path_factory):
    """Factory: ``cora_parts(k)`` is the path of Cora partitioned into k parts with METIS (cached)."""
    cache: dict = {}

    def get(parts: int, method: str = "metis") -> Path:
        key = (parts, method)
        if key not in cache:
            cache[key] = _partition(cora_graph, parts, tmp_path_factory.mktemp(f"cora{parts}{method}") / "p",
                                    method)
        return cache[key]

    return get
