"""Run `hpcgnn train ARGS...` with every PhaseTimer timing its phases through a counting stand-in
for ``torch.cuda`` (events stamped with perf_counter): the event path of a GPU run, on the CPU.
Prints one line ``SYNCS <json>``: per ``synchronize()`` call, the phases then open in each timer."""
import json
import sys
import time

import hpcgnn.run.timer as timer_mod


class StandInEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0      # milliseconds, as torch.cuda.Event's


class CountingCuda:
    Event = StandInEvent

    def __init__(self):
        self.timers, self.calls = [], []

    def synchronize(self, device=None):
        self.calls.append([list(t._open) for t in self.timers])


STAND_IN = CountingCuda()
_init = timer_mod.PhaseTimer.__init__


def _patched(self, sync_cuda=False, cuda_device=None, cuda=None):
    _init(self, True, None, STAND_IN)
    STAND_IN.timers.append(self)


timer_mod.PhaseTimer.__init__ = _patched

if __name__ == "__main__":
    from hpcgnn.cli import main

    rc = main(sys.argv[1:])
    print("SYNCS " + json.dumps(STAND_IN.calls), flush=True)
    sys.exit(rc)
