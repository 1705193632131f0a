"""Every torch allocation of an ``hpcgnn`` command, tracked on the CPU: a stand-in for the CUDA
allocator's ``max_memory_allocated`` where no GPU is at hand (calibrating the device estimate).

:class:`AllocationTracker` is a ``TorchDispatchMode``: every tensor an aten operator returns is
counted by its storage (views share it; a storage counts once, until the last tensor on it is
gone), so its ``peak`` is the largest sum of live storages. A new epoch (the rank's
:class:`~hpcgnn.run.timer.PhaseTimer` reset, which starts its memory meter) resets the peak to
what is live, as the meter resets CUDA's; the first segment is the set-up. At each new peak the live set is kept, grouped by the operator, shape and
the innermost hpcgnn frames that made each storage of 1 MiB or more, so a report says what the
peak holds. Not counted: memory torch does not allocate for an operator's output (numpy arrays,
``torch.from_numpy``, library workspaces).

Run under ``mpiexec`` like ``hpcgnn`` itself; every rank prints its epochs' peaks and writes
them to ``--out`` (HDF5, one file per rank) when given::

    mpiexec -n 2 python -m hpcgnn.bench.alloc_trace [--top 20] [--out DIR] -- train --config C \\
        --set train.kernels=torch
"""
from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LABELLED_BYTES = 1 << 20      # storages of at least this many bytes are labelled with their origin


class AllocationTracker(TorchDispatchMode):
    """Live bytes of the storages torch operators return while the mode is active (``current``),
    their largest sum since :meth:`new_epoch` (``peak``), and ``peak_set``: {label: bytes} of
    what was live at that peak. ``segments``: ``(peak, peak_set)`` of every finished segment
    (the first: from the mode's entry to the first :meth:`new_epoch`)."""

    def __init__(self, labelled_bytes: int = LABELLED_BYTES):
        super().__init__()
        self.labelled_bytes = int(labelled_bytes)
        self.live: dict[int, list] = {}       # storage pointer -> [bytes, label, tensors on it]
        self.refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_set: dict = {}
        self._kept_at = 0
        self.segments: list[tuple[int, dict]] = []

    def _label(self, func, t: torch.Tensor) -> str:
        frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack(limit=40)
                  if f"{os.sep}hpcgnn{os.sep}" in f.filename and not f.filename.endswith("alloc_trace.py")]
        return f"{func.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} @ " \
               + " < ".join(reversed(frames[-3:]))

    def _gone(self, key: int, ref) -> None:
        self.refs.pop(id(ref), None)
        entry = self.live.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self.live[key]
            self.current -= entry[0]

    def _count(self, func, t: torch.Tensor) -> None:
        if t.layout != torch.strided:        # sparse CSR: its index and value tensors
            if t.layout == torch.sparse_csr:
                for part in (t.crow_indices(), t.col_indices(), t.values()):
                    self._count(func, part)
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or t.device.type == "meta":
            return
        entry = self.live.get(key)
        if entry is None:
            nbytes = int(storage.nbytes())
            label = self._label(func, t) if nbytes >= self.labelled_bytes else "smaller tensors"
            self.live[key] = entry = [nbytes, label, 0]
            self.current += nbytes
        entry[2] += 1
        ref = weakref.ref(t, lambda r, key=key: self._gone(key, r))
        self.refs[id(ref)] = ref
        if self.current > self.peak:
            self.peak = self.current
            if self.current > self._kept_at * 1.002:       # keep the live set of a new peak
                self._kept_at = self.current
                grouped: dict = collections.Counter()
                for nbytes, label, _ in self.live.values():
                    grouped[label] += nbytes
                self.peak_set = dict(grouped)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(func, t)
        return out

    def new_epoch(self) -> None:
        """Close the segment under way and start the next at what is live now."""
        self.segments.append((self.peak, self.peak_set))
        self.peak = self.current
        self.peak_set = {}
        self._kept_at = 0

    def finish(self) -> list[tuple[int, dict]]:
        """Every segment's ``(peak bytes, {label: bytes live at the peak})``, the last one closed:
        the set-up, then one per epoch."""
        self.new_epoch()
        return self.segments


def report(segments: list[tuple[int, dict]], rank: int, top: int) -> str:
    """Lines: each segment's peak (MiB; the set-up, then the epochs) and its ``top`` largest
    groups of live storages."""
    lines = []
    for e, (peak, live) in enumerate(segments):
        what = "set-up" if e == 0 else f"epoch {e}"
        lines.append(f"alloc-trace: rank {rank} {what}: peak {peak / 2**20:.1f} MiB")
        for label, nbytes in sorted(live.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {nbytes / 2**20:9.1f} MiB  {label}")
    return "\n".join(lines)


def write(out_dir: str, rank: int, segments: list[tuple[int, dict]]) -> str:
    """``out_dir/alloc-trace-<rank>.h5``: ``peak_bytes`` [segments] (the set-up, then the epochs)
    and, per segment, the labels and bytes of its peak's live set (written to a temporary name,
    then renamed)."""
    import h5py
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"alloc-trace-{rank}.h5")
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = "hpcgnn-alloc-trace"
        f.create_dataset("peak_bytes", data=np.asarray([p for p, _ in segments], dtype=np.int64))
        for e, (_, live) in enumerate(segments):
            g = f.create_group(f"segment/{e:03d}")
            items = sorted(live.items(), key=lambda kv: -kv[1])
            g.create_dataset("labels", data=np.asarray([k.encode() for k, _ in items], dtype=object),
                             dtype=h5py.string_dtype())
            g.create_dataset("bytes", data=np.asarray([v for _, v in items], dtype=np.int64))
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m hpcgnn.bench.alloc_trace", description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=20, help="groups of live storages listed per epoch")
    p.add_argument("--out", default=None, help="folder for alloc-trace-<rank>.h5")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("give the hpcgnn command after --")

    from hpcgnn.run.timer import PhaseTimer

    tracker = AllocationTracker()
    reset = PhaseTimer.reset

    def new_epoch(timer):        # the training loop resets the timer as each epoch starts
        reset(timer)
        tracker.new_epoch()

    PhaseTimer.reset = new_epoch
    argv0, rc = sys.argv, 0
    sys.argv = ["hpcgnn", *command]
    try:
        with tracker:     # the program `python -m hpcgnn ...`, run as a profiler runs one
            runpy.run_module("hpcgnn", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        PhaseTimer.reset = reset
        sys.argv = argv0
    segments = tracker.finish()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    print(report(segments, rank, args.top), file=sys.stderr, flush=True)
    if args.out:
        write(args.out, rank, segments)
    return rc


if __name__ == "__main__":
    sys.exit(main())
