"""The portable native build: the baseline and AVX2 copies of the vectorised kernels agree, and
HPCGNN_NATIVE_ISA=baseline selects the baseline copy (native/isa.h)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcgnn.native import dropout, spmm

PROBE = r"""
import json, sys
import numpy as np
from hpcgnn.native import dropout, spmm
rng = np.random.default_rng(0)
n, d = 3000, 67                               # odd width: vector body and scalar tail
deg = rng.integers(0, 40, n)
indptr = np.zeros(n + 1, dtype=np.int64); indptr[1:] = np.cumsum(deg)
indices = rng.integers(0, n, int(indptr[-1])).astype(np.int64)
X = rng.standard_normal((n, d)).astype(np.float32)
w = rng.random(int(indptr[-1])).astype(np.float32)
rs = rng.random(n).astype(np.float32); cs = rng.random(n).astype(np.float32)
out = np.empty((n, d), np.float32)
spmm.spmm_sum(indptr, indices, X, out, edge_weight=w, row_scale=rs, col_scale=cs)
drop = np.empty_like(X)
dropout.dropout(X, drop, 0.3, 1234)
np.save(sys.argv[1] + "/spmm.npy", out); np.save(sys.argv[1] + "/drop.npy", drop)
print(json.dumps({"spmm": spmm.isa(), "dropout": dropout.isa(), "arch": spmm.build_arch}))
"""


def _run(tmp_path, name, **env):
    d = tmp_path / name
    d.mkdir()
    proc = subprocess.run([sys.executable, "-c", PROBE, str(d)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), np.load(d / "spmm.npy"), np.load(d / "drop.npy")


def test_module_reports_its_isa_and_build_arch():
    assert spmm.isa() in ("avx2", "baseline") and dropout.isa() == spmm.isa()
    assert isinstance(spmm.build_arch, str) and spmm.build_arch


def test_baseline_copy_equals_the_avx2_copy(tmp_path):
    info_b, spmm_b, drop_b = _run(tmp_path, "baseline", HPCGNN_NATIVE_ISA="baseline")
    assert info_b["spmm"] == info_b["dropout"] == "baseline"
    info_a, spmm_a, drop_a = _run(tmp_path, "auto")
    if info_a["spmm"] != "avx2":
        pytest.skip("this CPU has no AVX2+FMA: only the baseline copy runs")
    np.testing.assert_array_equal(drop_a, drop_b)                  # the mask is integer arithmetic
    np.testing.assert_allclose(spmm_a, spmm_b, rtol=1e-5, atol=1e-5)  # FMA may round differently
