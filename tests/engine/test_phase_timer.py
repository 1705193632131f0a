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
