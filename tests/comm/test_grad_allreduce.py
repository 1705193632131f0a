"""The bucketed gradient allreduce (:class:`hpcgnn.comm.allreduce.GradientAllreduce`), issue 26.

Real ``mpiexec -n 2`` and ``-n 4`` jobs, each running this file as its driver once, every
scenario on the mpi4py data plane and on gloo; the tests read what the ranks wrote:

* weighting: ranks with unequal sample counts per step (one with 0, one with 1, others more; an
  empty rank sometimes backwards a NaN loss of its empty batch) train a small MLP with
  ``grad_reduce = mean``: the parameters equal a one-process reference that trains on all the
  samples together (1e-6), differ from the old equal-rank mean, and are identical on all ranks;
* overlap: with many small buckets every bucket's allreduce starts before backward returns on
  a rank with samples (counted by a spy on the communicator), none on a rank without backward;
  a parameter without gradient holds back its bucket only, to after backward;
* buckets: every bucket size, with and without overlap, equals the single-bucket reduction
  (bitwise on mpi4py);
* divergence: NaN gradients on one rank, an inf loss on another, raise the same one line on
  every rank; a NaN loss of a rank with 0 samples does not;
* the minibatch engine at 2 ranks with unequal batches follows a one-process run.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import run_mpi  # noqa: E402

# per job size: samples of each rank in each step (one 0, one 1, the others more; they rotate)
COUNTS = {2: [[1, 4], [0, 5], [3, 1]], 4: [[0, 1, 3, 6], [5, 0, 1, 2], [2, 4, 0, 1]]}
LR = 0.5
SMALL = 16            # bytes per bucket in the overlap runs: 5 buckets of the MLP
SIZES = [4, 100, 1000, 1 << 25]


class WithUnused(torch.nn.Module):
    """``net`` after a parameter no forward uses (registered first: the last bucket's)."""

    def __init__(self, net):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(4))
        self.net = net

    def forward(self, x):
        return self.net(x)


def _model(unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 3))
    return WithUnused(m) if unused else m


def _data(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _slice(step: int, rank: int, size: int):
    counts = COUNTS[size][step]
    x, y = _data(step, sum(counts))
    lo = sum(counts[:rank])
    return x[lo:lo + counts[rank]], y[lo:lo + counts[rank]]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# ---- the driver (one per rank) ---------------------------------------------------------------
class Spy:
    """The communicator, counting the allreduces started."""

    def __init__(self, comm):
        self.comm, self.size, self.device, self.starts = comm, comm.size, comm.device, 0

    def start_allreduce_(self, buf):
        self.starts += 1
        return self.comm.start_allreduce_(buf)


def _train(comm, rank, size, bucket_bytes):
    """Three SGD steps with the weighted mean; returns the parameters and, per step, the
    allreduces started before backward returned (None without backward)."""
    from hpcgnn.comm.allreduce import GradientAllreduce

    model = _model()
    spy = Spy(comm)
    red = GradientAllreduce(model, spy, "mean", bucket_bytes=bucket_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    early = []
    for step in range(len(COUNTS[size])):
        x, y = _slice(step, rank, size)
        opt.zero_grad(set_to_none=True)
        spy.starts = 0
        red.begin(x.shape[0])
        loss = None
        if x.shape[0] or step == 1:       # step 1: an empty rank backwards its NaN loss
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            early.append(spy.starts)
        else:
            early.append(None)
        red(loss, 0, step, len(COUNTS[size]))
        opt.step()
    red.close()
    return _flat(model), early, red.num_buckets


def _one_step(comm, rank, size, bucket_bytes, overlap, unused=False):
    """The reduced gradients of one step, and the buckets started in backward."""
    from hpcgnn.comm.allreduce import GradientAllreduce

    model = _model(unused)
    red = GradientAllreduce(model, comm, "mean", bucket_bytes=bucket_bytes, overlap=overlap)
    x, y = _slice(2, rank, size)
    red.begin(x.shape[0])
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    red(loss)
    red.close()
    return _grads(model), red.started_in_backward, red.num_buckets


def _divergence(comm, rank, size):
    """The message each scenario raises on this rank ('' when none)."""
    from hpcgnn.comm.allreduce import GradientAllreduce
    from hpcgnn.errors import TrainingDiverged

    out = []
    model = _model()
    red = GradientAllreduce(model, comm, "mean", bucket_bytes=SMALL)
    for scenario in ("nan-grad", "inf-loss", "empty-nan"):
        x, y = _slice(0, rank, size)
        model.zero_grad(set_to_none=True)
        empty = scenario == "empty-nan" and rank == size - 1
        if empty:
            x, y = x[:0], y[:0]
        if scenario == "nan-grad" and rank == size - 1:
            x = x.clone()
            x[0, 0] = float("nan")              # NaN gradients (and loss) on this rank only
        red.begin(x.shape[0])
        loss = F.cross_entropy(model(x), y)     # NaN for the empty batch
        loss.backward()
        if scenario == "inf-loss" and rank == 1:     # (rank 1 has samples in step 0)
            loss = torch.tensor(float("inf"))
        try:
            red(loss, 5, 1, 4)
            out.append("")
        except TrainingDiverged as exc:
            out.append(str(exc))
    return out


def main(out: str) -> None:
    """Every scenario on the mpi4py data plane and on gloo, in one job."""
    from hpcgnn.comm.communicator_mpi import MpiCommunicator
    from hpcgnn.comm.data_plane import make_communicator
    from hpcgnn.runtime import Runtime

    torch.set_num_threads(1)
    rt = Runtime.start()
    result = {}
    for comm in (MpiCommunicator(rt.comm), make_communicator(rt, "gloo", "cpu")):
        params, early, nb = _train(comm, rt.rank, rt.size, SMALL)
        buckets = {(b, o): _one_step(comm, rt.rank, rt.size, b, o)[0] for b in SIZES for o in (True, False)}
        result[comm.name] = {
            "params": params, "early": early, "buckets_in_train": nb, "buckets": buckets,
            "single": _one_step(comm, rt.rank, rt.size, 1 << 30, False)[0],
            "unused": _one_step(comm, rt.rank, rt.size, SMALL, True, unused=True),
            "diverged": _divergence(comm, rt.rank, rt.size)}
    torch.save(result, Path(out) / f"rank{rt.rank}.pt")
    rt.finish()


# ---- the tests -------------------------------------------------------------------------------
BACKENDS = pytest.mark.parametrize("backend", ["mpi4py", "gloo"])


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def job(request, tmp_path_factory):
    size = request.param
    out = tmp_path_factory.mktemp(f"grad{size}")
    proc = run_mpi(size, [__file__, out], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return size, [torch.load(out / f"rank{r}.pt") for r in range(size)]


def _same(a: torch.Tensor, b: torch.Tensor, backend: str) -> None:
    """Bitwise on mpi4py; gloo's sums of more than two ranks may associate by message size."""
    if backend == "mpi4py":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def _reference(size: int, weighted: bool) -> torch.Tensor:
    """One process: SGD on all the samples of each step together (``weighted``), or the old
    equal-rank mean of the per-rank mean gradients (an empty rank adding zeros)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(len(COUNTS[size])):
        opt.zero_grad(set_to_none=True)
        if weighted:
            x, y = _data(step, sum(COUNTS[size][step]))
            F.cross_entropy(model(x), y).backward()
        else:
            total = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(size):
                x, y = _slice(step, r, size)
                if x.shape[0]:
                    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
                    total = [t + g for t, g in zip(total, grads)]
            for p, t in zip(model.parameters(), total):
                p.grad = t / size
        opt.step()
    return _flat(model)


@BACKENDS
def test_the_mean_weighs_ranks_by_their_samples(job, backend):
    size, ranks = job
    ranks = [r[backend] for r in ranks]
    params = ranks[0]["params"]
    assert all(torch.equal(params, r["params"]) for r in ranks)        # identical everywhere
    assert (params - _reference(size, True)).abs().max().item() <= 1e-6
    assert (params - _reference(size, False)).abs().max().item() > 1e-3


@BACKENDS
def test_every_bucket_starts_during_backward(job, backend):
    size, ranks = job
    ranks = [r[backend] for r in ranks]
    for rank, r in enumerate(ranks):
        assert r["buckets_in_train"] == 5
        for step, early in enumerate(r["early"]):
            if COUNTS[size][step][rank] or step == 1:    # a backward ran: every bucket before it returned
                assert early == r["buckets_in_train"], (rank, step)
            else:
                assert early is None
        # the unused parameter is in the last bucket: the others start in backward, it after
        grads, started, nb = r["unused"]
        assert nb >= 2 and started == nb - 1
        assert torch.equal(grads[:4], torch.zeros(4))
        _same(grads[4:], r["single"], backend)


@BACKENDS
def test_every_bucket_size_equals_one_bucket(job, backend):
    _, ranks = job
    for r in ranks:
        for (b, overlap), grads in r[backend]["buckets"].items():
            _same(grads, r[backend]["single"], backend)


@BACKENDS
def test_divergence_raises_the_same_line_on_every_rank(job, backend):
    _, ranks = job
    ranks = [r[backend] for r in ranks]
    for i, kind in enumerate(["nan", "inf"]):
        msgs = {r["diverged"][i] for r in ranks}
        assert len(msgs) == 1
        assert re.fullmatch(rf"training diverged at epoch 5, step 2 of 4: the loss or a gradient is not finite "
                            rf"\({kind}\); no checkpoint was written for it \(lower train\.lr, check the input "
                            rf"features\)", msgs.pop())
    assert all(r["diverged"][2] == "" for r in ranks)     # a rank with 0 samples: its NaN ignored


def test_one_rank_passes_gradients_through_and_refuses_bad_arguments():
    from hpcgnn.comm.allreduce import GradientAllreduce

    model = _model()
    red = GradientAllreduce(model, SimpleNamespace(size=1), "mean", bucket_bytes=SMALL)
    x, y = _data(0, 6)
    red.begin(6)
    F.cross_entropy(model(x), y).backward()
    before = _grads(model).clone()
    assert red.started_in_backward == red.num_buckets >= 4
    red(None)
    assert torch.equal(_grads(model), before)
    with pytest.raises(ValueError, match="grad_reduce must be 'mean' or 'sum'"):
        GradientAllreduce(model, SimpleNamespace(size=1), "avg")
    with pytest.raises(ValueError, match="samples must be >= 0"):
        red.begin(-1)


class _MirrorPlane:
    """Stand-in for a 2-rank data plane whose other rank holds the same values (the sum doubles)."""
    size, device = 2, "cpu"

    def start_allreduce_(self, buf):
        buf.mul_(2)
        return SimpleNamespace(wait=lambda: None)


def test_a_step_reads_the_device_once():
    """Σ n_r, the late flag and the finiteness test come back in one host read per step (one
    wait for the device on a GPU data plane), counted over every tensor-to-host conversion."""
    from hpcgnn.comm.allreduce import GradientAllreduce
    from hpcgnn.errors import TrainingDiverged

    from host_reads import HostReads

    model = _model()
    red = GradientAllreduce(model, _MirrorPlane(), "mean", bucket_bytes=SMALL)
    x, y = _data(0, 6)
    red.begin(6)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    before = _grads(model).clone()
    with HostReads() as reads:
        red(loss.detach())
    assert reads.names == ["tolist"]
    assert torch.allclose(_grads(model), before, rtol=1e-6, atol=0)   # (2 * 6 g) / (2 * 6)
    x[0, 0] = float("nan")
    red.begin(6)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(TrainingDiverged, match=r"not finite \(nan\)"):
        red(None)


MB_CONFIG = ("[model]\nhidden = 8\nlayers = 2\ndropout = 0.0\n[train]\nepochs = 2\neval_every = 0\nlr = 0.05\n"
             "[minibatch]\nbatch_size = 1000\nfanouts = [64, 64]\nhalo = \"exact\"\n")


def test_minibatch_engine_with_unequal_batches_follows_one_process(tmp_path):
    """2 ranks with 75 and 7 training vertices, one batch each per epoch, every neighbour
    (fanouts above the largest degree, halo 'exact', no dropout): the weighted mean makes each
    step the one-process full-batch step, so the parameters after 2 Adam steps agree (the
    equal-rank mean ends 0.3 away)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    import mb_support as mb

    graph = mb.tiny_graph(no_train_range=(180, 330))
    assert (graph.train_mask[:180].sum(), graph.train_mask[180:].sum()) == (75, 7)
    cfg = mb.write_config(tmp_path / "cfg.toml", MB_CONFIG)
    params = []
    for n in (1, 2):
        run = tmp_path / f"run{n}"
        proc = mb.train(n, cfg, mb.tiny_store(tmp_path / f"parts{n}", graph, n), run, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        params.append(torch.load(run / "checkpoints" / "ckpt-000002.pt", weights_only=False)["model"])
    one, two = params
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-6


if __name__ == "__main__":
    main(sys.argv[1])
