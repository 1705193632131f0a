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

``--passes`` (the offloaded full graph, ``fullgraph.offload = true``) also prints, per layer
pass of :class:`~hpcgnn.engine.offload.OffloadEngine`, the peak of the storages made during the
pass that would be device memory on a GPU (:class:`PassTracker`: the host-resident layer data
and gradients, ``engine/transfer.py``'s host buffers, and the chunks' cached host transposes
left out), the figure :func:`hpcgnn.engine.estimate.offload_phase_bytes` models.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
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


class PassTracker(AllocationTracker):
    """:class:`AllocationTracker` that also keeps ``device``: the live bytes of storages whose
    label, its line numbers left out, names none of ``host_labels`` (storages under
    ``labelled_bytes`` count as device memory), and, through :meth:`watch`, the peak of those
    above what was live when a method began, per key: ``passes`` {key: bytes}."""

    HOST_LABELS = ("host_empty", "host_zeros", "block.py::transpose")

    def __init__(self, labelled_bytes: int = 1 << 16, host_labels=HOST_LABELS):
        super().__init__(labelled_bytes)
        self.host_labels = tuple(host_labels)
        self.device = 0
        self.device_peak = 0
        self._host: set[int] = set()
        self.passes: dict = {}

    def _count(self, func, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr() if t.layout == torch.strided else None
        new = key is not None and key not in self.live
        super()._count(func, t)
        if new and key in self.live:
            nbytes, label, _ = self.live[key]
            label = re.sub(r":\d+:", "::", label)
            if any(h in label for h in self.host_labels):
                self._host.add(key)
            else:
                self.device += nbytes
                self.device_peak = max(self.device_peak, self.device)

    def _gone(self, key: int, ref) -> None:
        entry = self.live.get(key)
        super()._gone(key, ref)
        if entry is not None and key not in self.live:
            if key in self._host:
                self._host.discard(key)
            else:
                self.device -= entry[0]

    def watch(self, cls, name: str, key_of) -> None:
        """Wrap ``cls.name``: each call's peak of device storages above its start goes to
        ``passes[key_of(*args)]`` (the largest over calls)."""
        method = getattr(cls, name)

        def traced(*args, **kwargs):
            start, outer = self.device, self.device_peak
            self.device_peak = start
            try:
                return method(*args, **kwargs)
            finally:
                key = key_of(*args)
                self.passes[key] = max(self.passes.get(key, 0), self.device_peak - start)
                self.device_peak = max(outer, self.device_peak)

        setattr(cls, name, traced)


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


def write(out_dir: str, rank: int, segments: list[tuple[int, dict]], passes: dict | None = None) -> str:
    """``out_dir/alloc-trace-<rank>.h5``: ``peak_bytes`` [segments] (the set-up, then the epochs)
    and, per segment, the labels and bytes of its peak's live set; with ``passes``
    ({(pass, layer): bytes}, :class:`PassTracker`) also ``passes/names`` ("forward 0", ...) and
    ``passes/peak_bytes`` (written to a temporary name, then renamed)."""
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
        if passes is not None:
            items = sorted(passes.items())
            f.create_dataset("passes/names", data=np.asarray([f"{k[0]} {k[1]}".encode() for k, _ in items],
                                                             dtype=object), dtype=h5py.string_dtype())
            f.create_dataset("passes/peak_bytes", data=np.asarray([v for _, v in items], dtype=np.int64))
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m hpcgnn.bench.alloc_trace", description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=20, help="groups of live storages listed per epoch")
    p.add_argument("--out", default=None, help="folder for alloc-trace-<rank>.h5")
    p.add_argument("--passes", action="store_true",
                   help="also the device-side peak of each offloaded layer pass (fullgraph.offload)")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("give the hpcgnn command after --")

    from hpcgnn.run.timer import PhaseTimer

    tracker = PassTracker() if args.passes else AllocationTracker()
    reset = PhaseTimer.reset
    if args.passes:
        from hpcgnn.engine.offload import OffloadEngine

        saved = {n: getattr(OffloadEngine, n) for n in ("_forward_layer", "_backward_layer")}
        tracker.watch(OffloadEngine, "_forward_layer", lambda self, l, *a: ("forward", l))
        tracker.watch(OffloadEngine, "_backward_layer", lambda self, l, *a: ("backward", l))

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
        if args.passes:
            for n, m in saved.items():
                setattr(OffloadEngine, n, m)
    segments = tracker.finish()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    text = report(segments, rank, args.top)
    if args.passes:
        text += f"\nalloc-trace: rank {rank} device-side peak per offloaded pass: " + ", ".join(
            f"{k[0]} layer {k[1]} {v / 2**20:.1f} MiB" for k, v in sorted(tracker.passes.items()))
    print(text, file=sys.stderr, flush=True)
    if args.out:
        write(args.out, rank, segments, tracker.passes if args.passes else None)
    return rc


if __name__ == "__main__":
    sys.exit(main())
