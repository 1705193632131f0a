"""PhaseTimer records the nesting of its phases (hpcgnn/run/timer.py), and the loop hands it
with every engine timing's declared parent to the run file (hpcgnn/engine/loop.py)."""
from __future__ import annotations

import itertools

import pytest

import hpcgnn.run.timer as common
from hpcgnn.run.timer import PhaseTimer
from hpcgnn.engine.loop import EpochResult, epoch_timings


@pytest.fixture
def clock(monkeypatch):
    """perf_counter ticks 1 s per call: every phase's seconds are exact counts of clock reads."""
    ticks = itertools.count()
    monkeypatch.setattr(common.time, "perf_counter", lambda: float(next(ticks)))


def test_three_levels_and_a_phase_reentered_at_another_depth(clock):
    t = PhaseTimer()
    with t.phase("epoch"):                  # reads 0 ... 9
        with t.phase("forward"):            # 1 ... 6
            with t.phase("cache"):          # 2 ... 5
                with t.phase("lookup"):     # 3, 4
                    pass
        with t.phase("cache"):              # 7, 8: depth 2 now, first opened at depth 3
            pass
    with t.phase("eval"):                   # 10, 11
        with t.phase("forward"):            # 12, 13: another parent than the first forward's
            pass
    assert t.parents == {"epoch": None, "forward": "epoch", "cache": "forward", "lookup": "cache",
                         "epoch/cache": "epoch", "eval": None, "eval/forward": "eval"}
    assert list(t.parents) == ["epoch", "forward", "cache", "lookup", "epoch/cache", "eval", "eval/forward"]
    assert t.seconds == {"lookup": 1.0, "cache": 3.0, "forward": 5.0, "epoch/cache": 1.0, "epoch": 9.0,
                         "eval/forward": 1.0, "eval": 3.0}
    # the same place again accumulates under the same name; the nesting outlives reset()
    t.reset()
    with t.phase("epoch"):
        with t.phase("forward"):
            with t.phase("cache"):
                pass
    assert t.seconds == {"cache": 1.0, "forward": 3.0, "epoch": 5.0}
    assert t.parents["cache"] == "forward"


def test_a_phase_inside_itself_is_not_counted_twice(clock):
    t = PhaseTimer()
    with t.phase("forward"):                # 0 ... 3
        with t.phase("forward"):            # 1, 2
            pass
    assert t.seconds == {"forward": 3.0, "forward/forward": 1.0}
    assert t.parents == {"forward": None, "forward/forward": "forward"}


def test_a_phase_left_by_an_exception_closes(clock):
    t = PhaseTimer()
    with pytest.raises(RuntimeError):
        with t.phase("forward"):
            raise RuntimeError("boom")
    with t.phase("backward"):
        pass
    assert t.parents == {"forward": None, "backward": None}      # not nested in the failed one


def test_add_needs_a_parent_and_refuses_another_one():
    t = PhaseTimer()
    t.add("comm_wait", 0.5, parent="forward")
    t.add("comm_wait", 0.25, parent="forward")
    assert t.seconds == {"comm_wait": 0.75} and t.parents == {"comm_wait": "forward"}
    with pytest.raises(TypeError):
        t.add("push", 0.1)                                   # no parent declared
    with pytest.raises(ValueError, match="comm_wait"):
        t.add("comm_wait", 0.1, parent=None)


def test_epoch_timings_take_the_timers_nesting_and_the_engines_declared_parents(clock):
    t = PhaseTimer()
    with t.phase("epoch"):
        with t.phase("forward"):
            with t.phase("cache"):
                pass
    with t.phase("eval"):
        pass
    result = EpochResult(1.0, timings={"comm_wait": 0.5, "halo": 0.25},
                         timing_parents={"comm_wait": "forward", "halo": "forward+backward+eval"})
    timings, parents = epoch_timings(t, result)
    assert parents == {"epoch": "", "forward": "epoch", "cache": "forward", "eval": "",
                       "comm_wait": "forward", "halo": "forward+backward+eval"}
    assert list(timings) == list(parents) and timings["comm_wait"] == 0.5 and timings["epoch"] == 5.0
    with pytest.raises(ValueError, match="halo"):
        epoch_timings(t, EpochResult(1.0, timings={"halo": 0.25}))


# ---- device timing: CUDA events, resolved once per epoch ------------------------------------

class _Event:
    """torch.cuda.Event stand-in: record() stamps the (test) clock; elapsed_time in ms."""

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = common.time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class _CountingCuda:
    Event = _Event

    def __init__(self):
        self.syncs = 0

    def synchronize(self, device=None):
        self.syncs += 1


def test_device_phases_use_events_and_one_synchronize_when_read(clock):
    cuda = _CountingCuda()
    t = PhaseTimer(sync_cuda=True, cuda=cuda)
    for _ in range(3):                            # three steps, phases nested two deep
        with t.phase("epoch"):                    # (the same clock reads as the host path)
            with t.phase("forward"):
                with t.phase("cache"):
                    pass
            with t.phase("sample", host=True):    # a host phase: perf_counter, no events
                pass
    assert cuda.syncs == 0                        # nothing waited for the device in the loop
    assert t.seconds == {"cache": 3.0, "forward": 9.0, "sample": 3.0, "epoch": 21.0}
    assert cuda.syncs == 1 and t.syncs == 1       # one synchronize resolves the epoch
    assert t.seconds["epoch"] == 21.0 and cuda.syncs == 1     # nothing pending: no second one
    t.reset()
    with t.phase("epoch"):
        pass
    assert cuda.syncs == 1 and t.seconds == {"epoch": 1.0} and cuda.syncs == 2


# (config, ranks, threads per rank, extra settings, top-level phases the run must have)
DEVICE_RUNS = {
    "fullgraph": ("cora-gcn-fullgraph.toml", 1, 1, [], {"housekeeping", "forward", "backward", "allreduce", "update"}),
    # 4 threads: the gather thread runs the loader (minibatch k + 2 sampled while k computes)
    "minibatch-hec": ("cora-sage.toml", 2, 4, ["minibatch.halo=hec", "minibatch.batch_size=32"],
                      {"housekeeping", "sample", "store_wait", "forward", "backward", "allreduce", "optimizer"}),
    "tensor": ("cora-tensor.toml", 1, 1, [], {"housekeeping", "nn", "split", "gather", "aggregate", "allreduce",
                                              "optimizer"}),
}


@pytest.mark.parametrize("name", list(DEVICE_RUNS))
def test_device_run_synchronizes_only_at_the_epoch_end_and_phases_cover_the_epoch(cora_parts, tmp_path, name):
    """A real CPU training run whose timers time every phase through CUDA events (a counting
    stand-in, tests/engine/timer_events_driver.py): synchronize() is called once per epoch with
    no phase open, and the recorded top-level phases of ``epoch`` sum to it within 5 % (the
    issue's bound) on every rank, over the run's epochs."""
    import json
    import sys
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from mpiutil import ROOT, run_mpi
    from hpcgnn.run.runfile import read_run, timing_parents

    config, ranks, threads, extra, phases = DEVICE_RUNS[name]
    epochs = 4
    sets = [a for kv in extra for a in ("--set", kv)]
    proc = run_mpi(ranks, [Path(__file__).parent / "timer_events_driver.py", "train", "--config",
                           ROOT / "inputs" / config, "--set", f"data.partitions={cora_parts(ranks)}",
                           "--set", f"output.dir={tmp_path / 'run'}", "--set", f"train.epochs={epochs}",
                           "--set", "train.eval_every=2", *sets], timeout=240, cwd=ROOT,
                   env={"HPCGNN_THREADS": str(threads)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dec = json.JSONDecoder()         # (not per line: mpiexec may join the ranks' last lines)
    for piece in proc.stdout.split("SYNCS ")[1:]:                 # one per rank
        syncs = dec.raw_decode(piece)[0]
        assert len(syncs) == epochs                               # one per epoch ...
        assert all(open_phases == [[]] for open_phases in syncs)  # ... with no phase open
    assert proc.stdout.count("SYNCS ") == ranks
    run = read_run(tmp_path / "run")
    t, parents = run["timings"], timing_parents(run)
    inside = [k for k, p in parents.items() if p == "epoch"]
    assert phases <= set(inside), inside
    total = sum(t[k] for k in inside)                              # [epoch, rank]
    epoch = t["epoch"]
    # nested phases stay inside their parent; the per-epoch housekeeping (counter resets, the
    # loss allreduce, the minibatch order) is a phase too, so what is outside any phase is the
    # loop's own few lines: measured 98-99.8 % covered over 4 epochs on a loaded 2-core
    # machine (single epochs down to 92 % when a rank is descheduled between two phases)
    assert np.all(total <= epoch * (1 + 1e-9)), (total, epoch)
    assert np.all(total.sum(axis=0) >= 0.95 * epoch.sum(axis=0)), (total, epoch)
    if name == "minibatch-hec":
        # the loader's sampling overlaps the epoch's phases: its own timing, outside the total
        assert parents["sample_loader"] == "loader" and (t["sample_loader"] > 0).all()
