"""hpcgnn: distributed GNN training on partitioned HDF5 graphs.

Packages (one concept each):
  data/       canonical graph file, importers, synthetic generators
  partition/  partitioners (METIS multi-constraint, random, contiguous) and the partition store
  runtime.py  MPI process runtime (ranks, threads, abort-on-exception, torch.distributed)
  comm/       collectives as autograd functions, halo providers, asynchronous embedding push
  sampling/   neighbour sampler, sampled blocks, distributed (exact) sampling
  cache/      historical embedding cache
  nn/         aggregation kernels, dropout and models (GraphSAGE, GAT, GCN)
  engine/     the engine registry (registry.py, specs/), the shared training loop (loop.py),
              hooks, and the engines (minibatch, fullgraph, tensor); docs/engines.md
  seeding.py  random streams as functions of integers
  run/        configuration, run output (HDF5), checkpoints
  plan/       `hpcgnn plan`: calibrated memory and epoch-time predictions per engine setting
  commands/   the `hpcgnn` subcommands
"""

__version__ = "0.1.0"
