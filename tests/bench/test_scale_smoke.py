"""`make bench-scale` end to end on a tiny products-like graph (2 ranks, 1 epoch): every step runs,
the HDF5 file holds each step's wall time and peak memory, and per-rank peaks per epoch."""

import h5py
import numpy as np



def test_bench_scale_smoke(tmp_path, monkeypatch):
    from hpcgnn.bench import scale

    monkeypatch.setenv("HPCGNN_THREADS", "1")
    out = tmp_path / "scale.h5"
    rc = scale.main(["--scale", "0.01", "--ranks", "2", "--epochs", "1", "--out", str(out),
                     "--timeout", "240"])
    assert rc == 0
    with h5py.File(out, "r") as f:
        assert set(f) == {"prepare", "partition", "minibatch", "fullgraph"}
        for name in f:
            assert f[name].attrs["rc"] == 0 and f[name].attrs["wall_s"] > 0
            assert f[name].attrs["peak_rss_bytes"] > 50e6
        peaks = f["minibatch/peak_rss_bytes_per_rank"][()]
        assert peaks.shape == (1, 2) and np.all(peaks > 50e6)
        assert 0 <= f["minibatch"].attrs["test_acc"] <= 1
