"""`make bench-scale` end to end on a tiny products-like graph (2 ranks, 1 epoch): every step runs,
the HDF5 file holds each step's wall time and peak memory, and per-rank peaks per epoch."""

import h5py
import numpy as np
import pytest


def test_bench_scale_smoke(tmp_path, monkeypatch):
    from hpcgnn.bench import scale

    monkeypatch.setenv("HPCGNN_THREADS", "1")
    out = tmp_path / "scale.h5"
    rc = scale.main(["--scale", "0.01", "--ranks", "2", "--epochs", "1", "--out", str(out),
                     "--timeout", "240", "--engines", "minibatch,fullgraph,tensor", "--device", "cpu",
                     "--set", "model.hidden=24", "--set", "runtime.device_memory_limit=1TiB"])
    assert rc == 0
    with h5py.File(out, "r") as f:
        assert set(f) == {"prepare", "partition", "minibatch", "fullgraph", "tensor"}
        assert f.attrs["device"] == "cpu" and f.attrs["sets"] == "model.hidden=24 runtime.device_memory_limit=1TiB"
        # the compute device's peak per rank (on the CPU: the meter of device-placed tensors) and
        # the pre-run estimate of it (made against the stated device size)
        assert np.all(f["minibatch/peak_device_bytes_per_rank"][()] > 0)
        assert f["minibatch/estimated_peak_device_bytes_per_rank"].shape == (2,)
        assert np.all(f["minibatch/estimated_peak_device_bytes_per_rank"][()] > 0)
        for name in f:
            assert f[name].attrs["rc"] == 0 and f[name].attrs["wall_s"] > 0
            assert f[name].attrs["peak_rss_bytes"] > 50e6
        peaks = f["minibatch/peak_rss_bytes_per_rank"][()]
        assert peaks.shape == (1, 2) and np.all(peaks > 50e6)
        assert 0 <= f["minibatch"].attrs["test_acc"] <= 1


def test_bench_scale_names_an_unknown_engine(capsys):
    from hpcgnn.bench import scale

    with pytest.raises(SystemExit) as exc:
        scale.main(["--engines", "minibatch,graphsaint"])
    assert exc.value.code == 2
    assert "--engines: unknown graphsaint (expected minibatch, fullgraph, tensor)" in capsys.readouterr().err
