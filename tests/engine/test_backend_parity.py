"""``runtime.backend`` carries every engine's data plane: each engine and mode at 2 and 4 ranks
with ``gloo`` follows the ``mpi4py`` run's loss curve within 1e-5 (dropout off, 20 epochs), its
comm byte counters are equal, and ``labels/comm_backend`` says which backend carried the data;
``infer`` of those runs gives the same rows. Impossible pairs (nccl on the CPU, ccl without
oneCCL's bindings) are one line and exit 2 on every rank.

Real mpiexec runs on a tiny graph (360 vertices, contiguous parts): every (mode, backend) of one
rank count runs in ONE launch (tests/jobs_driver.py runs the jobs one after the
other, a fresh Runtime each), so the whole file costs two training launches.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import run_jobs  # noqa: E402

from hpcgnn.commands.report import format_table, summarise  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

EPOCHS = 20
BACKENDS = ("mpi4py", "gloo")
RANKS = (2, 4)
CONFIG = f"""
[model]
arch = "gcn"
hidden = 8
layers = 2
dropout = 0.0
[train]
epochs = {EPOCHS}
lr = 0.01
seed = 3
eval_every = 0
[minibatch]
batch_size = 24
fanouts = [3, 3]
nc = 6
"""
# mode -> --set overrides (engine and mode); every mode runs with each backend of BACKENDS
MODES = {
    "mb-exact": ["train.engine=minibatch", "minibatch.halo=exact"],
    "mb-hec": ["train.engine=minibatch", "minibatch.halo=hec", "minibatch.push_delay=1"],
    "mb-aep": ["train.engine=minibatch", "minibatch.halo=hec", "minibatch.push_delay=2", "minibatch.push_limit=2"],
    "fg-exact": ["train.engine=fullgraph"],
    "fg-offload": ["train.engine=fullgraph", "fullgraph.offload=true", "fullgraph.chunks=2"],
    "fg-cached": ["train.engine=fullgraph", "fullgraph.halo=cached", "fullgraph.staleness=2"],
    "fg-pipelined": ["train.engine=fullgraph", "fullgraph.pipeline=true", "fullgraph.staleness=1"],
    "tp-decoupled": ["train.engine=tensor", "tensor.k=2"],
    "tp-coupled": ["train.engine=tensor", "tensor.mode=coupled", "tensor.k=0"],
    "tp-chunked": ["train.engine=tensor", "tensor.k=2", "tensor.chunks=3"],
}
INFER = ("fg-exact", "tp-decoupled", "mb-hec")   # runs whose checkpoint `infer` reads, per backend
ENV = {"HPCGNN_THREADS": "1"}


def _is_comm_bytes(name: str) -> bool:
    """Counters of bytes that crossed between ranks (not memory: peak RSS, device or host stores)."""
    return "bytes" in name and not any(w in name for w in ("rss", "memory", "mem_", "peak", "store_", "h2d",
                                                           "d2h", "device", "host", "pinned"))


@pytest.fixture(scope="module", params=RANKS, ids=lambda r: f"{r}ranks")
def runs(request, tmp_path_factory):
    """One launch per rank count: every mode with every backend, then `infer` of some of them."""
    ranks = request.param
    d = tmp_path_factory.mktemp(f"parity{ranks}")
    parts = mb.tiny_store(d / "parts", mb.tiny_graph(), ranks)
    cfg = mb.write_config(d / "cfg.toml", CONFIG)
    jobs = []
    for mode, sets in MODES.items():
        for backend in BACKENDS:
            jobs.append({"kind": "train", "config": str(cfg),
                         "set": [f"data.partitions={parts}", f"output.dir={d / mode / backend}",
                                 f"runtime.backend={backend}", *sets],
                         "verbose": mode == "mb-hec"})
    for mode in INFER:
        for backend in BACKENDS:
            jobs.append({"kind": "infer", "run": str(d / mode / backend), "out": str(d / f"{mode}-{backend}.h5")})
    proc = run_jobs(ranks, jobs, d, timeout=400, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ranks, d, proc


@pytest.mark.parametrize("mode", list(MODES))
def test_gloo_follows_mpi4py(runs, mode):
    ranks, d, _ = runs
    ref, got = read_run(d / mode / "mpi4py"), read_run(d / mode / "gloo")
    for r, backend in ((ref, "mpi4py"), (got, "gloo")):
        assert r["attrs"]["status"] == "finished"
        labels = r["labels"].get("comm_backend")
        assert labels is not None, f"{mode}/{backend}: the run file has no labels/comm_backend"
        assert labels.shape == (EPOCHS, ranks) and (labels == backend).all(), (mode, backend, labels)
        assert (r["labels"]["mpi_library"] != "").all()
        s = summarise(r)                                       # `hpcgnn report` shows it
        assert s["comm_backend"] == backend and s["mpi_library"] == str(r["labels"]["mpi_library"][0, 0])
        assert f"comm       data plane {backend}; MPI {s['mpi_library']}" in format_table(s).splitlines()
    a, b = ref["metrics"]["loss"], got["metrics"]["loss"]
    assert a.shape == b.shape == (EPOCHS,) and np.isfinite(a).all()
    assert a[-1] < a[0]                                        # it trains
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=mode)
    # the gradient buckets start during backward with either backend (after the first epoch,
    # which counts the accumulations of the full-pass engines)
    for r in (ref, got):
        started = r["counters"]["allreduce_buckets_in_backward"]
        assert (started[1:] >= 1).all(), (mode, started)
    names = [k for k in ref["counters"] if _is_comm_bytes(k)] + \
        [k for k in ref["per_layer"] if _is_comm_bytes(k)]
    assert names, f"{mode}: no comm byte counter recorded"
    assert sum(float(np.nansum(ref["counters"].get(k, ref["per_layer"].get(k)))) for k in names) > 0
    for k in names:
        x = ref["counters"].get(k, ref["per_layer"].get(k))
        y = got["counters"].get(k, got["per_layer"].get(k))
        assert y is not None, f"{mode}: gloo run lacks {k}"
        np.testing.assert_array_equal(y, x, err_msg=f"{mode}: {k}")


@pytest.mark.parametrize("mode", INFER)
def test_infer_rows_equal_over_backends(runs, mode):
    _, d, _ = runs
    rows = {}
    for backend in BACKENDS:
        with h5py.File(d / f"{mode}-{backend}.h5", "r") as f:
            assert f.attrs["comm_backend"] == backend
            rows[backend] = f["logits"][()]
    assert np.isfinite(rows["mpi4py"]).all()
    np.testing.assert_allclose(rows["gloo"], rows["mpi4py"], rtol=1e-5, atol=1e-5)


def test_verbose_names_the_data_plane_and_the_mpi_library(runs):
    from hpcgnn.runtime import mpi_library

    ranks, _, proc = runs
    for backend in BACKENDS:
        line = f"hpcgnn: data plane {backend} on {ranks} rank(s); MPI library {mpi_library()}"
        assert proc.stdout.count(line) == 1, proc.stdout[-2000:]


@pytest.mark.parametrize("backend", ["nccl", "ccl"])
def test_impossible_backend_is_one_line_on_every_rank(tmp_path, backend):
    from hpcgnn.comm.communicator import ccl_available

    if backend == "ccl" and ccl_available():
        pytest.skip("oneccl_bindings_for_pytorch imports here: ccl runs on the CPU")
    parts = mb.tiny_store(tmp_path / "parts", mb.tiny_graph(), 2)
    cfg = mb.write_config(tmp_path / "cfg.toml", CONFIG)
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={parts}",
                                              "--set", f"output.dir={tmp_path / 'run'}",
                                              "--set", f"runtime.backend={backend}", "--set", "train.device=cpu"],
                                          timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"hpcgnn: error: runtime.backend = '{backend}'"), proc.stderr
    assert not (tmp_path / "run").exists()    # refused before any data or output
    if backend == "nccl":
        assert "needs train.device = 'cuda'" in errors[0]


def test_infer_refuses_nccl_on_the_cpu(runs, tmp_path):
    """`infer --backend nccl` (or a run's nccl) on the CPU: one line, exit 2 on every rank,
    nothing written."""
    ranks, d, _ = runs
    if ranks != 2:
        pytest.skip("one rank count is enough")
    out = tmp_path / "logits.h5"
    proc, codes = mb.train_each_rank_exit(2, ["infer", str(d / "fg-exact" / "gloo"), "--out", str(out),
                                              "--backend", "nccl", "--device", "cpu"], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith("hpcgnn: error: runtime.backend = 'nccl' needs "
                                                     "train.device = 'cuda'"), proc.stderr
    assert not out.exists()


def test_infer_of_a_run_whose_backend_cannot_follow(runs, tmp_path):
    """A run recorded with runtime.backend = 'nccl' inferred on CPUs: without --device it is one
    line naming the setting; with --device cpu the data plane is auto's choice, said in one warning."""
    import shutil

    from hpcgnn.comm.communicator import choose_backend

    ranks, d, _ = runs
    if ranks != 2:
        pytest.skip("one rank count is enough")
    run = tmp_path / "nccl-run"
    shutil.copytree(d / "fg-exact" / "gloo", run)
    with h5py.File(run / "run.h5", "r+") as f:
        cfg = json.loads(f.attrs["config"])
        cfg["runtime"]["backend"] = "nccl"
        f.attrs["config"] = json.dumps(cfg)
    proc, codes = mb.train_each_rank_exit(2, ["infer", str(run), "--out", str(tmp_path / "a.h5")], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and "runtime.backend = 'nccl'" in errors[0] and "pass --backend" in errors[0], errors
    proc, codes = mb.train_each_rank_exit(2, ["infer", str(run), "--out", str(tmp_path / "b.h5"), "--device", "cpu"],
                                          timeout=120)
    assert codes == {0: 0, 1: 0}, proc.stdout + proc.stderr
    chosen = choose_backend("auto", "cpu")
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("hpcgnn: warning:")]
    assert len(warnings) == 1 and f"using {chosen!r}" in warnings[0], proc.stderr
    with h5py.File(tmp_path / "b.h5", "r") as f, h5py.File(d / "fg-exact-gloo.h5", "r") as g:
        assert f.attrs["comm_backend"] == chosen
        np.testing.assert_allclose(f["logits"][()], g["logits"][()], rtol=1e-5, atol=1e-5)
