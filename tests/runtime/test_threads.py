"""runtime.threads as a per-rank list: each rank runs with its own thread count (recorded in the
run file), a list of the wrong length stops every rank with one line and exit 2; a RAPA store
with trimmed halos trains (its owners' send lists match the receivers' halo rows)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph  # noqa: E402

from hpcgnn.cli import main  # noqa: E402
from hpcgnn.data.graph import write_graph  # noqa: E402
from hpcgnn.errors import InputError  # noqa: E402
from hpcgnn.partition.store import read_meta  # noqa: E402
from hpcgnn.run.config import load_config  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = """
[model]
arch = "gcn"
hidden = 8
layers = 2
dropout = 0.0
[train]
engine = "fullgraph"
epochs = 2
eval_every = 0
checkpoint_every = 0
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("threads")
    graph = d / "g.h5"
    write_graph(graph, toy_graph(400, 6.0, num_features=8, num_classes=4, seed=7))
    store = d / "rapa"
    assert main(["partition", str(graph), "--parts", "2", "--rank-speed", "1,2", "--halo-trim",
                 "--out", str(store), "--quiet"]) == 0
    cfg = d / "t.toml"
    cfg.write_text(CONFIG)
    return d, cfg, store


def train(cfg, store, run, *sets):
    extra = [a for s in sets for a in ("--set", s)]
    return run_mpi(2, ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                       "--set", f"output.dir={run}", *extra], timeout=240)


def test_per_rank_threads_are_applied_and_recorded(setup):
    d, cfg, store = setup
    meta_trim = json.loads(read_meta(store).attrs["halo_trim"])
    assert sum(meta_trim["removed_halos"]) > 0        # the store really is trimmed
    r = train(cfg, store, d / "run", "runtime.threads=[1, 2]")
    assert r.returncode == 0, r.stderr[-3000:]
    run = read_run(d / "run")
    assert json.loads(run["attrs"]["rank_threads"]) == [1, 2]
    assert run["attrs"]["status"] == "finished"


def test_wrong_length_stops_every_rank(setup):
    d, cfg, store = setup
    r = train(cfg, store, d / "bad", "runtime.threads=[1, 2, 3]")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["hpcgnn: error: runtime.threads = [1, 2, 3] has 3 entries but the job has 2 ranks, "
                     "expected one thread count per rank"], r.stderr
    assert not (d / "bad" / "run.h5").exists()


@pytest.mark.parametrize("value, ok", [("[1, 2]", True), ("3", True), ("0", True), ("[]", False),
                                       ("[0, 1]", False), ("[1.5]", False), ("-1", False), ("[true]", False)])
def test_threads_key_validation(value, ok):
    if ok:
        load_config(None, ["data.partitions=x", f"runtime.threads={value}"])
    else:
        with pytest.raises(InputError, match="runtime.threads"):
            load_config(None, ["data.partitions=x", f"runtime.threads={value}"])
