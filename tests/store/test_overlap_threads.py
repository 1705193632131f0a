"""The store's gather thread and the main thread share the rank's T threads: while a gather is in
flight the gather thread's OpenMP team (what the native gather runs with) and the main thread's
teams (native kernels, torch intra-op) add up to T; with T = 1 there is no gather thread; the
team sizes are in the run file and do not change the loss."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph  # noqa: E402

from hpcgnn import native  # noqa: E402
from hpcgnn.store.device import DeviceFeatureStore  # noqa: E402
from hpcgnn.store.host import HostFeatureStore  # noqa: E402
from hpcgnn.store.prefetch import Prefetcher, set_calling_thread_team, split_threads  # noqa: E402
from hpcgnn.store.tiered import TieredFeatureStore  # noqa: E402


@pytest.fixture
def main_team():
    """Set the main thread's teams per test; put back what it had."""
    before = torch.get_num_threads()
    yield set_calling_thread_team
    set_calling_thread_team(before)


def _feats(n=2000, d=16):
    return np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)


def _teams():
    """(native team, torch intra-op count) of the calling thread."""
    return native.team_size(), torch.get_num_threads()


def test_split_threads_adds_up():
    assert split_threads(1) == (0, 1) and split_threads(0) == (0, 1)
    assert split_threads(2) == (0, 2) and split_threads(3) == (0, 3)   # inline below 4 threads
    assert split_threads(2, min_threads=2) == (1, 1) and split_threads(4) == (1, 3)
    assert split_threads(8) == (2, 6) and split_threads(4, share=0.5) == (2, 2)
    assert split_threads(5, share=0.99) == (4, 1)            # the main thread keeps one
    for t in range(4, 65):
        g, c = split_threads(t)
        assert g >= 1 and c >= 1 and g + c == t


@pytest.mark.parametrize("store_kind", ["host", "tiered"])
@pytest.mark.parametrize("T", [4, 8])
def test_gather_and_main_teams_add_up_to_the_rank_threads(main_team, T, store_kind):
    main_team(T)
    feats = _feats()
    store = HostFeatureStore(feats) if store_kind == "host" else TieredFeatureStore(feats, np.arange(0, 2000, 3))
    pf = Prefetcher(store, True, threads=T)
    g, c = split_threads(T)
    assert pf.overlap and (pf.gather_threads, pf.compute_threads) == (g, c)
    read = store.read_misses
    seen, in_read, release = [], threading.Event(), threading.Event()

    def probe(plan):
        before = _teams()
        rows = read(plan)                 # the real native gather, on the gather thread
        seen.append((threading.current_thread() is not threading.main_thread(), before, _teams()))
        in_read.set()
        assert release.wait(60)
        return rows

    store.read_misses = probe
    ids = [torch.from_numpy(np.random.default_rng(k).integers(0, 2100, 700)) for k in range(3)]
    try:
        for k in range(2):                # the first and a later gather of the same thread
            in_read.clear()
            release.clear()
            h = pf.submit(ids[k])
            assert in_read.wait(60)
            during = _teams()             # main thread, gather k in flight
            release.set()
            rows = pf.get(h)
            on_thread, gather_before, gather_after = seen[k]
            assert on_thread
            assert gather_before == gather_after == (g, g), (k, gather_before, gather_after)
            assert during == (c, c)
            assert gather_after[0] + during[0] == T and gather_after[1] + during[1] == T
            assert _teams() == (T, T)     # nothing in flight: the main thread has all T again
            assert np.array_equal(rows.numpy(), np.where((ids[k] < 2000).numpy()[:, None],
                                                         feats[np.minimum(ids[k].numpy(), 1999)], 0))
    finally:
        release.set()
        pf.close()


def test_main_team_stays_split_while_any_gather_is_pending(main_team):
    main_team(4)
    store = HostFeatureStore(_feats())
    pf = Prefetcher(store, True, threads=4)
    ids = torch.arange(0, 2000, 7)
    h1 = pf.submit(ids)
    h2 = pf.submit(ids)                   # the engine's double buffer: two pending
    pf.get(h1)
    assert _teams() == (3, 3)
    pf.get(h2)
    assert _teams() == (4, 4)
    pf.submit(ids)                        # never collected: close gives the threads back
    assert _teams() == (3, 3)
    pf.close()
    assert _teams() == (4, 4)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_no_gather_thread_with_few_threads_or_nothing_to_read(main_team, T):
    """Below 4 threads: no worker thread at all. A device store (nothing to read on a thread)
    reads inline, on the main thread, with all T threads; from 4 threads it still gets the
    worker thread as the engine's loader (sampling ahead), whose team is taken only while it
    has work."""
    main_team(T)
    feats = _feats()
    store = HostFeatureStore(feats) if T < 4 else DeviceFeatureStore(feats)
    pf = Prefetcher(store, True, threads=T)
    assert not pf.overlap and pf.loader == (T >= 4)
    assert (pf.gather_threads, pf.compute_threads) == (split_threads(T) if T >= 4 else (0, T))
    threads = []
    read = store.read_misses
    store.read_misses = lambda plan: (threads.append(threading.current_thread()), read(plan))[1]
    h = pf.submit(torch.arange(10))
    assert _teams() == (T, T)
    assert np.array_equal(pf.get(h).numpy(), feats[:10])
    assert threads == [threading.main_thread()]            # inline, in get
    if pf.loader:
        fut = pf.run(threading.current_thread)
        assert _teams()[0] == pf.compute_threads           # the main team shrinks while it works
        assert pf.wait(fut) is not threading.main_thread() and _teams() == (T, T)
    else:
        with pytest.raises(RuntimeError, match="needs a worker thread"):
            pf.run(threading.current_thread)
    pf.close()


CONFIG = """
[model]
arch = "sage"
hidden = 16
layers = 2
dropout = 0.0
[train]
engine = "minibatch"
epochs = 2
eval_every = 2
checkpoint_every = 0
[minibatch]
batch_size = 32
fanouts = [5, 5]
[store]
device_memory = 0
"""


def test_team_sizes_are_recorded_and_do_not_change_the_loss(tmp_path):
    from hpcgnn.cli import main
    from hpcgnn.data.graph import write_graph
    from hpcgnn.run.runfile import read_run

    write_graph(tmp_path / "g.h5", toy_graph(600, 6.0, num_features=24, num_classes=4, seed=3))
    assert main(["partition", str(tmp_path / "g.h5"), "--parts", "2", "--out", str(tmp_path / "p"),
                 "--quiet"]) == 0
    (tmp_path / "c.toml").write_text(CONFIG)
    runs = {}
    for overlap in ("true", "false"):
        run = tmp_path / f"run-{overlap}"
        r = run_mpi(2, ["-m", "hpcgnn", "train", "--config", tmp_path / "c.toml", "--set",
                        f"data.partitions={tmp_path / 'p'}", "--set", f"output.dir={run}", "--set",
                        "runtime.threads=[1, 4]", "--set", f"store.overlap={overlap}"],
                    timeout=240, env={"HPCGNN_THREADS": ""})
        assert r.returncode == 0, r.stderr[-3000:]
        runs[overlap] = read_run(run)
    on, off = runs["true"]["attrs"], runs["false"]["attrs"]
    assert json.loads(on["rank_threads"]) == [1, 4]
    # rank 0 (T = 1): no gather thread; rank 1 (T = 4): one gather thread and three compute threads
    assert json.loads(on["store_gather_threads"]) == [0, 1]
    assert json.loads(on["store_compute_threads"]) == [1, 3]
    assert [p["overlap"] for p in json.loads(on["store_placement"])] == [False, True]
    assert json.loads(off["store_gather_threads"]) == [0, 0]
    assert json.loads(off["store_compute_threads"]) == [1, 4]
    ref = runs["false"]["metrics"]["loss"]
    loss = runs["true"]["metrics"]["loss"]
    assert np.isfinite(ref).all() and np.all(np.abs(loss - ref) <= 1e-6 * np.abs(ref)), (loss, ref)
