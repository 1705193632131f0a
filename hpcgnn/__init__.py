"""hpcgnn: distributed GNN training on partitioned HDF5 graphs.

The map, one concept per package or module, in layers (:data:`LAYERS`, bottom first). A module
imports modules of its own layer or of lower ones, never of a higher one, and no module imports
itself through others (tests/test_layers.py computes the import graph and checks both).

0 foundation
  __init__.py    this map, the version
  errors.py      InputError (one-line user errors) and the exit codes
  units.py       byte sizes as text: parse_size, fmt_bytes
  seeding.py     random streams as functions of integers
  native.py      the compiled kernels (native/), one extension module per family
  log.py         what hpcgnn says: Python logging, rank 0's records, --quiet / -v
  progress.py    progress bar for long preprocessing steps, heartbeat for long ones that cannot count
  supervisor.py  a rank's watcher: which signal killed it, and why
  fileio.py      atomic file output, one-line errors for unreadable inputs
  upload.py      host-to-device copies of a step that do not wait for the device
  ids.py         sets of integer IDs (np.unique's slow hash path avoided)
1 kernels
  sampling/      neighbour sampler, sampled blocks
  cache/         caches of remote rows: historical embedding cache (HEC), two-tier halo cache
  nn/            aggregation kernels, dropout, models (GraphSAGE, GAT, GCN) and Adam (optim.py:
                 torch.optim.Adam's results without its import of TorchDynamo)
2 ranks, exchanges, data
  runtime/       MPI process runtime: the Runtime class (rank.py: ranks, threads,
                 abort-on-exception, torch.distributed), process tuning (process.py), GPU
                 placement (gpu.py), the launcher and environment of a child MPI job (child.py)
  comm/          collectives as autograd functions, halo providers, asynchronous embedding push,
                 the exact minibatch mode's distributed sampling and feature pull (exact_fetch.py),
                 the gradient and evaluation-count allreduces (allreduce.py)
  data/          canonical graph file, importers, synthetic generators
  store/         feature and topology store over device and host memory (docs/store.md)
3 run
  run/           configuration (config.py) and the engines' sections (engines/: the registry
                 and one spec per engine), the run file (layout and reader: runfile.py; writer:
                 output.py; the checks of --resume: resume.py), the run directory's lock
                 (lock.py), checkpoints and the training state saved in them (checkpoint.py),
                 phase timing (timer.py), memory measurement (memory.py), the collective
                 writer of `hpcgnn infer`'s per-vertex rows file (rows_file.py), what a run prints
                 (console.py), per-epoch CSV and TensorBoard export (export.py)
4 partition/     partitioners (METIS multi-constraint, random, contiguous), the partitioning steps
                 from a graph file to a store (pipeline.py), the partition store and its summary
                 (summary.py)
5 engine/        the shared training loop (loop.py), hooks, the engines (minibatch, fullgraph,
                 tensor), the device choice (device.py), the model and optimizer built from the
                 configuration (model.py),
                 global accuracies (metrics.py), the layer-wise inference algorithm
                 (inference.py), the rows `hpcgnn infer` computes from a checkpoint
                 (predict.py) and memory: each engine's coarse terms (memory_*.py), their
                 shared part (estimate.py: inspect, plan's memory figures) and train's checks
                 (memory_check.py: before the run and after the measured first step);
                 docs/engines.md
6 plan/          `hpcgnn plan`: calibrated memory and epoch-time predictions per engine setting
7 commands/      the `hpcgnn` subcommands
  demos/         a tiny MPI program that checks a launch and the runtime (hello.py)
8 cli.py         the `hpcgnn` command: one entry point, a module of commands/ per subcommand
  __main__.py    `python -m hpcgnn`

Outside the package, in the checkout: benchmarks/ (the `make bench-*` drivers, which import
hpcgnn) and tools/ (the GPU check drivers and wheels, which import benchmarks and hpcgnn); hpcgnn
imports neither.
"""

__version__ = "0.1.0"

LAYERS = (
    ("__init__", "errors", "units", "seeding", "native", "log", "progress", "supervisor", "fileio", "upload", "ids"),
    ("sampling", "cache", "nn"),
    ("runtime", "comm", "data", "store"),
    ("run",),
    ("partition",),
    ("engine",),
    ("plan",),
    ("commands", "demos"),
    ("cli", "__main__"),
)
