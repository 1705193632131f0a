"""benchmarks.results_file: the layout of every benchmark's HDF5 file, read back exactly."""
from __future__ import annotations

import h5py
import numpy as np

from benchmarks.results_file import write_results


def test_layout_round_trip(tmp_path):
    out = tmp_path / "sub" / "b.h5"
    results = {
        "case a/b": {"epoch_s": 0.25, "ok": True, "note": "x", "times": [1.0, 2.0], "skip": None,
                     "phases": {"forward": 3, "backward": np.float64(4.5)}},
        "rows": [{"n": 1}, {"n": 2}],
        "grid": np.arange(6).reshape(2, 3),
        "names": ["exact", "S2+pipe"],
    }
    write_results(out, results, {"scale": 0.04, "host": np.str_("h"), "model": {"hidden": 8}, "cases": ["a", "b"]},
                  "hpcgnn-bench-test")
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-test"
        assert f.attrs["scale"] == 0.04 and f.attrs["host"] == "h"
        assert f.attrs["model"] == '{"hidden": 8}' and f.attrs["cases"] == '["a", "b"]'
        g = f["case a_b"]                                   # "/" would have made a path
        assert g.attrs["epoch_s"] == 0.25 and bool(g.attrs["ok"]) and g.attrs["note"] == "x"
        assert "skip" not in g.attrs and "skip" not in g
        assert np.array_equal(g["times"][()], [1.0, 2.0])
        assert g["phases"].attrs["forward"] == 3 and g["phases"].attrs["backward"] == 4.5
        assert [f["rows"][k].attrs["n"] for k in sorted(f["rows"])] == [1, 2]
        assert np.array_equal(f["grid"][()], np.arange(6).reshape(2, 3))
        assert f["names"].asstr()[()].tolist() == ["exact", "S2+pipe"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["b.h5"]  # no temporary left
