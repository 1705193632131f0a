"""--feature-dtype float16 / bfloat16: features stored in 16 bits (bfloat16 as uint16 bit
patterns with an attribute naming the dtype), hashed as stored, decoded to float32 by
read_graph exactly as numpy (float16) and torch (bfloat16) round them."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from hpcgnn.cli import main
from hpcgnn.data.features import decode_features, encode_features
from hpcgnn.data.graph import read_graph, write_graph
from hpcgnn.data.synthetic import SbmParams, generate_sbm
from hpcgnn.errors import InputError

SBM = ["--dataset", "sbm", "--nodes", "2000", "--edges", "10000", "--features", "12", "--seed", "1"]


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def test_encoding_rounds_as_numpy_and_torch():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((500, 7)) * np.exp(rng.uniform(-20, 20, (500, 1)))).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 1e-40]
    for dtype in ("float16", "bfloat16"):
        y = np.clip(x, -6e4, 6e4) if dtype == "float16" else x
        assert np.array_equal(decode_features(encode_features(y, dtype), dtype), rounded(y, dtype))
    assert encode_features(x, "bfloat16").dtype == np.uint16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prepare_stores_and_read_graph_decodes(tmp_path, dtype, capsys):
    out, ref = tmp_path / "g.h5", tmp_path / "ref.h5"
    assert main(["prepare", *SBM, "--feature-dtype", dtype, "--out", str(out)]) == 0
    assert f"features {dtype}" in capsys.readouterr().out
    assert main(["prepare", *SBM, "--out", str(ref)]) == 0
    g, r = read_graph(out), read_graph(ref)
    assert g.features.dtype == np.float32 and np.array_equal(g.features, rounded(r.features, dtype))
    assert np.array_equal(g.indices, r.indices) and g.meta["feature_dtype"] == dtype
    raw = read_graph(out, decode_features=False).features
    assert raw.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
    with h5py.File(out) as f:
        assert f.attrs["feature_dtype"] == dtype
        assert f["features"].dtype == raw.dtype and f["features"].nbytes * 2 == 2000 * 12 * 4
        if dtype == "bfloat16":
            assert f["features"].attrs["dtype"] == "bfloat16"
    with h5py.File(out, "r+") as f:      # the hash covers the stored bits
        f["features"][3, 4] = f["features"][3, 4] ^ 1 if dtype == "bfloat16" else f["features"][3, 4] * 2 + 1
    with pytest.raises(InputError, match=r"dataset 'features' does not match the file's recorded content hash"):
        read_graph(out)


def test_in_memory_writer_takes_the_dtypes(tmp_path):
    g = generate_sbm(SbmParams(nodes=500, edges=3000, features=4, classes=3))
    write_graph(tmp_path / "g.h5", g, feature_dtype="bfloat16", index_dtype="auto")
    back = read_graph(tmp_path / "g.h5")
    assert np.array_equal(back.features, rounded(g.features, "bfloat16")) and np.array_equal(back.indices, g.indices)
    with h5py.File(tmp_path / "g.h5") as f:
        assert f["indices"].dtype == np.int32


def test_float16_overflow_is_one_line(tmp_path, capsys):
    x = np.ones((3, 2), np.float32)
    x[2, 1] = 1e5
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.array([0, 1, 0]))
    (tmp_path / "e.csv").write_text("0,1\n1,2\n")
    out = tmp_path / "g.h5"
    assert main(["prepare", "--dataset", "files", "--edges", str(tmp_path / "e.csv"), "--features",
                 str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"), "--feature-dtype", "float16",
                 "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hpcgnn:")]   # not progress
    assert len(err) == 1 and "feature 100000 at row 2 does not fit float16 (largest 65504)" in err[0], err
    assert not out.exists()
