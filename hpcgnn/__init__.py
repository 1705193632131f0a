"""hpcgnn: distributed GNN training on partitioned HDF5 graphs.

Packages (one concept each):
  data/       canonical graph file, importers, synthetic generators
  partition/  partitioners (METIS multi-constraint, random, contiguous) and the partition store
  runtime.py  MPI process runtime (ranks, threads, abort-on-exception, torch.distributed)
  comm/       collectives as autograd functions, asynchronous embedding push
  sampling/   neighbour sampler and sampled blocks
  cache/      historical embedding cache
  nn/         aggregation kernels, dropout and models (GraphSAGE, GAT, GCN)
  engine/     training engines (minibatch, fullgraph)
  run/        configuration, run output (HDF5), checkpoints
  commands/   the `hpcgnn` subcommands
"""

__version__ = "0.1.0"
