"""The tensor engine's device path, exercised with the CPU as the device (no GPU here): with
``tensor.staged = true`` the chunks and their source rows are staged host->device, aggregated
there and copied back, the same code ``train.device = "cuda"`` runs. Real mpiexec -n 2 on Cora,
dropout off: the staged losses follow the unstaged ones within 1e-5 relative (decoupled GCN
chunked and pipelined, GAT, coupled without pipelining; one chunk and the torch operators CUDA
runs are checked in process, tests/engine/test_tensor_layout.py). ``tensor.chunks = "auto"``
with a small ``tensor.device_memory`` picks the count the estimate predicts, records it and the
per-chunk working set, and trains exactly as that count set by hand; a budget too small for one
destination row per chunk stops every rank with one line (exit 2)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mb_support as mb  # noqa: E402
from mpiutil import run_mpi  # noqa: E402

from hpcgnn.errors import InputError  # noqa: E402
from hpcgnn.run.output import read_run  # noqa: E402

EPOCHS = 20
CONFIG = f"""
[model]
arch = "gcn"
hidden = 16
layers = 2
dropout = 0.0
[train]
engine = "tensor"
epochs = {EPOCHS}
lr = 0.01
weight_decay = 5e-4
seed = 4
eval_every = 0
[tensor]
k = 3
alpha = 0.1
gamma = 0.9
"""
ENV = {"HPCGNN_THREADS": "1"}
TIMEOUT = 240
GAT = ["--set", "model.arch=gat", "--set", "tensor.k=2"]
COUPLED = ["--set", "tensor.mode=coupled", "--set", "tensor.k=0", "--set", "tensor.alpha=0.0",
           "--set", "tensor.gamma=1.0"]
# name: (unstaged reference, options of the staged run)
CASES = {
    "gcn-3": ("gcn-3", ["--set", "tensor.chunks=3"]),
    "gat-3": ("gat-3", [*GAT, "--set", "tensor.chunks=3"]),
    "coupled-2-nopipe": ("coupled-2", [*COUPLED, "--set", "tensor.chunks=2", "--set", "tensor.pipeline=false"]),
}
REFS = {"gcn-3": ["--set", "tensor.chunks=3"], "gat-3": [*GAT, "--set", "tensor.chunks=3"],
        "coupled-2": [*COUPLED, "--set", "tensor.chunks=2"]}


def train(d: Path, store: Path, name: str, *extra):
    run = d / name
    proc = run_mpi(2, ["-m", "hpcgnn", "train", "--config", d / "tp.toml", "--set", f"data.partitions={store}",
                       "--set", f"output.dir={run}", "--force", *extra], timeout=TIMEOUT, env=ENV)
    return proc, run


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cora_parts):
    d = tmp_path_factory.mktemp("tensordev")
    (d / "tp.toml").write_text(CONFIG)
    store = cora_parts(2)
    refs = {}
    for name, opts in REFS.items():
        proc, run = train(d, store, f"ref-{name}", *opts)
        assert proc.returncode == 0, proc.stderr[-3000:]
        refs[name] = read_run(run)
    staged = {}
    for name, (_, opts) in CASES.items():
        proc, run = train(d, store, f"staged-{name}", "--set", "tensor.staged=true", *opts)
        assert proc.returncode == 0, proc.stderr[-3000:]
        staged[name] = read_run(run)
    return d, store, refs, staged


@pytest.mark.parametrize("name", list(CASES))
def test_staged_follows_the_unstaged_losses(setup, name):
    _, _, refs, staged = setup
    ref, got = refs[CASES[name][0]], staged[name]
    a, b = ref["metrics"]["loss"], got["metrics"]["loss"]
    assert a.shape == b.shape == (EPOCHS,) and a[-1] < 0.97 * a[0]          # it learns
    rel = np.abs(b / a - 1).max()
    assert rel < 1e-5, rel
    attrs, c = got["attrs"], got["counters"]
    assert attrs["tensor_staged"] and not ref["attrs"]["tensor_staged"]
    # the same collectives as unstaged; host<->device traffic on every rank, every epoch
    assert attrs["tensor_chunks"] == ref["attrs"]["tensor_chunks"]
    for key in ("layout_alltoalls", "split_calls", "gather_calls", "split_bytes", "gather_bytes"):
        assert np.array_equal(c[key], ref["counters"][key]), key
    for key in ("h2d_rows_bytes", "d2h_out_bytes", "h2d_grad_bytes", "d2h_grad_bytes", "peak_device_bytes"):
        assert np.all(c[key] > 0), key
    # de-duplication: consecutive chunks share rows, so fewer rows move than chunk sources
    assert np.all(c["h2d_rows_bytes"] <= c["h2d_rows_nodedup_bytes"])
    if attrs["tensor_chunks"] > 1:
        assert np.all(c["h2d_rows_bytes"] < c["h2d_rows_nodedup_bytes"])
    if name.startswith("gat"):
        assert np.all(c["d2h_edge_grad_bytes"] > 0)


def _predicted(store, budget: int, cfg_extra: list[str], d: Path) -> tuple[int, int, int]:
    from hpcgnn.engine.estimate import auto_chunks
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    cfg = load_config(d / "tp.toml", [f"data.partitions={store}", *cfg_extra])
    return auto_chunks(cfg, read_meta(store), 2, budget, "cpu")


def test_auto_chunks_fit_the_budget_and_train_as_set_by_hand(setup):
    """The budget is chosen so that the estimate predicts 3 chunks (the hand-set staged run)."""
    from hpcgnn.engine.estimate import tensor_device_bytes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    d, store, _, staged = setup
    cfg = load_config(d / "tp.toml", [f"data.partitions={store}"])
    meta = read_meta(store)
    need = [sum(tensor_device_bytes(cfg, meta, 2, k, "cpu")) for k in (2, 3)]
    assert need[1] < need[0]
    budget = (need[0] + need[1]) // 2
    k, nn_b, chunk_b = _predicted(store, budget, [], d)
    assert k == 3 and nn_b + chunk_b <= budget
    proc, run = train(d, store, "auto", "--set", "tensor.staged=true", "--set", "tensor.chunks=auto",
                      "--set", f"tensor.device_memory={budget}B")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor.chunks = auto: 3 chunk(s)" in proc.stdout, proc.stdout
    r = read_run(run)
    a = r["attrs"]
    assert a["tensor_chunks"] == 3 and a["tensor_chunks_setting"] == "auto"
    assert a["tensor_device_budget_bytes"] == budget
    assert a["tensor_device_nn_bytes"] == nn_b and a["tensor_device_chunk_bytes"] == chunk_b
    assert np.array_equal(r["metrics"]["loss"], staged["gcn-3"]["metrics"]["loss"])
    # the measured device working set of the chunks is within the estimated per-chunk bytes
    assert np.all(r["counters"]["peak_device_bytes"] <= chunk_b), (r["counters"]["peak_device_bytes"], chunk_b)


def test_budget_below_one_row_per_chunk_exits_2_on_every_rank(setup):
    d, store, _, _ = setup
    args = ["train", "--config", str(d / "tp.toml"), "--set", f"data.partitions={store}",
            "--set", f"output.dir={d / 'tiny'}", "--force", "--set", "tensor.chunks=auto",
            "--set", "tensor.device_memory=1KiB"]
    proc, codes = mb.train_each_rank_exit(2, args)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpcgnn: error:")]
    assert len(lines) == 1 and "tensor.device_memory" in lines[0] and "one destination row" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_device_budget_forms():
    from hpcgnn.run.engines.tensor import device_budget

    assert device_budget("auto", "cpu", None) is None
    assert device_budget("2GiB", "cpu", None) == 2 << 30
    assert device_budget("auto", "cuda", 80 << 30) == int(0.9 * (80 << 30))
    assert device_budget(0.5, "cuda", 80 << 30) == 40 << 30
    with pytest.raises(InputError, match="tensor.device_memory.*needs train.device = 'cuda'"):
        device_budget(0.5, "cpu", None)
    with pytest.raises(InputError, match="tensor.device_memory"):
        device_budget(3, "cuda", 80 << 30)
    with pytest.raises(InputError, match="tensor.device_memory"):
        device_budget("lots", "cpu", None)


def test_auto_is_one_chunk_without_a_budget_and_the_smallest_that_fits(setup):
    from hpcgnn.engine.estimate import tensor_device_bytes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    d, store, _, _ = setup
    assert _predicted(store, None, [], d)[0] == 1
    cfg = load_config(d / "tp.toml", [f"data.partitions={store}"])
    meta = read_meta(store)
    nn_b = tensor_device_bytes(cfg, meta, 2, 1, "cpu")[0]      # the NN layers: the same for every count
    for budget in (nn_b + 700_000, nn_b + 300_000, nn_b + 100_000, nn_b + 1_000):
        k = _predicted(store, budget, [], d)[0]
        assert sum(tensor_device_bytes(cfg, meta, 2, k, "cpu")) <= budget
        if k > 1:
            assert sum(tensor_device_bytes(cfg, meta, 2, k - 1, "cpu")) > budget
