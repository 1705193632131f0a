"""`make bench-scale` end to end on a tiny products-like graph (2 ranks, 1 epoch): every step runs,
the HDF5 file holds each step's wall time and peak memory, and per-rank peaks per epoch."""

import h5py
import numpy as np
import pytest


def test_bench_scale_smoke(tmp_path, monkeypatch):
    from benchmarks import scale

    monkeypatch.setenv("HPCGNN_THREADS", "1")
    out = tmp_path / "scale.h5"
    rc = scale.main(["--scale", "0.01", "--ranks", "2", "--epochs", "1", "--out", str(out),
                     "--timeout", "240", "--engines", "minibatch,fullgraph,tensor,offload,cached", "--device", "cpu",
                     "--set", "model.hidden=24", "--set", "runtime.device_memory_limit=1TiB"])
    assert rc == 0
    with h5py.File(out, "r") as f:
        assert set(f) == {"prepare", "partition", "minibatch", "fullgraph", "tensor", "offload", "cached"}
        # the offloaded step trains two epochs, the cached one three (its first reuse is epoch 1,
        # its first resend of the cached rows epoch 3)
        for name, epochs in (("offload", 2), ("cached", 3)):
            assert f[name]["epoch_time_s"].shape == (epochs,) and np.all(f[name]["epoch_time_s"][()] > 0)
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
    # a step skipped at the deadline is not given the figures of an older run file in its folder
    import argparse

    run_dir = tmp_path / "scale-work-s0.01" / "run-fullgraph"
    assert (run_dir / "run.h5").exists()
    args = argparse.Namespace(scale=0.01, ranks=2, epochs=1, seed=0, device="cpu", sets=[])
    skipped = {"wall_s": 0.0, "peak_rss_bytes": 0.0, "rc": None, "tail": ""}
    rows = scale.write_results(tmp_path / "again.h5", args, {"fullgraph": skipped}, {"fullgraph": run_dir})
    assert rows[0]["note"] == "skipped: no time left before --deadline" and "epoch_s" not in rows[0]
    with h5py.File(tmp_path / "again.h5", "r") as f:
        assert f["fullgraph"].attrs["rc"] == scale.NOT_STARTED and "epoch_time_s" not in f["fullgraph"]


def test_bench_scale_names_an_unknown_engine(capsys):
    from benchmarks import scale

    with pytest.raises(SystemExit) as exc:
        scale.main(["--engines", "minibatch,graphsaint"])
    assert exc.value.code == 2
    assert ("--engines: unknown graphsaint (expected minibatch, fullgraph, tensor, offload, cached)"
            in capsys.readouterr().err)


def test_bench_scale_skips_what_the_deadline_leaves_no_time_for(tmp_path, capsys):
    """Past ``--deadline`` no step starts; the file still says which steps were skipped."""
    import time

    from benchmarks import scale

    out = tmp_path / "scale.h5"
    assert scale.main(["--scale", "0.01", "--ranks", "2", "--out", str(out), "--deadline", f"{time.time() - 1:.0f}",
                       "--engines", "fullgraph"]) == 0
    with h5py.File(out, "r") as f:
        assert set(f) == {"prepare"}        # nothing after a step that did not run
        assert f["prepare"].attrs["rc"] == scale.NOT_STARTED
        assert f["prepare"].attrs["error"] == "skipped: no time left before --deadline"
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("prepare ")]
    assert len(rows) == 1 and " ".join(rows[0][-6:]) == "skipped: no time left before --deadline"
