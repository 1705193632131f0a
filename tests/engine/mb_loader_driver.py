"""MPI driver for test_minibatch_loader.py: the same minibatch run with the loader (store.overlap
= true, 4 threads: a gather thread) and without it (store.overlap = false), with an event log.

usage: mb_loader_driver.py PARTS RUN_ROOT CONFIG [KEY=VALUE ...]   (extra --set of both runs)
Writes RUN_ROOT/on and RUN_ROOT/off. Prints one line per rank ``LOADER <rank> <json>``: per run,
the minibatches sampled on the loader (``loaded``: [epoch, step]), those sampled on the main
thread (``inline``), and ``while_computing``: for each loaded minibatch j, whether its sampling
had finished before step j - 2's after_step returned, which waits for it (up to 60 s): the
loader samples j while j - 2 computes. Without a loader that wait would never end in time (the
main thread samples j only after step j - 2), so the run with the loader off does not wait.
"""
import json
import sys
import threading

from mpi4py import MPI

from hpcgnn.cli import main
from hpcgnn.engine import hooks as hooks_mod
from hpcgnn.engine import minibatch as mb_mod
from hpcgnn.store import prefetch as prefetch_mod

parts, root, config = sys.argv[1:4]
extra = [a for kv in sys.argv[4:] for a in ("--set", kv)]
log = {}
done: dict = {}
lock = threading.Lock()


def _event(key):
    with lock:
        return done.setdefault(key, threading.Event())


_sample = mb_mod.MinibatchEngine._sample


def sample(self, seeds, epoch, k):
    result = _sample(self, seeds, epoch, k)
    on_main = threading.current_thread() is threading.main_thread()
    with lock:
        log["inline" if on_main else "loaded"].append([int(epoch), int(k)])
    _event((epoch, k)).set()
    return result


_run = prefetch_mod.Prefetcher.run


def run(self, fn, *args):
    if getattr(fn, "__func__", None) is sample:
        log["submitted"].add((int(args[1]), int(args[2])))
    return _run(self, fn, *args)


_after = hooks_mod.TrainHooks.after_step


def after_step(self, epoch, k, *rest):
    if (epoch, k + 2) in log["submitted"]:
        log["while_computing"].append(bool(_event((epoch, k + 2)).wait(60)))
    return _after(self, epoch, k, *rest)


mb_mod.MinibatchEngine._sample = sample
prefetch_mod.Prefetcher.run = run
hooks_mod.TrainHooks.after_step = after_step

out = {}
for name, overlap in (("on", "true"), ("off", "false")):
    log.update(loaded=[], inline=[], submitted=set(), while_computing=[])
    done.clear()
    rc = main(["train", "--config", config, "--set", f"data.partitions={parts}",
               "--set", f"output.dir={root}/{name}", "--set", f"store.overlap={overlap}",
               "--set", "runtime.threads=4", *extra])
    if rc != 0:
        raise SystemExit(rc)
    out[name] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in log.items()}
print(f"LOADER {MPI.COMM_WORLD.Get_rank()} {json.dumps(out)}", flush=True)
