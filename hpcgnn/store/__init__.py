"""The *vertex data store*: a rank's in-memory feature store and graph store over device and
host memory, XGNN-style (docs/store.md). Every engine reads vertex feature rows (and the
minibatch and full-graph engines their local topology) through it. Not to be confused with the
on-disk *partition store* (:mod:`hpcgnn.partition.store`, ``data.partitions``), the HDF5 files
the vertex data store is filled from.

``base`` (interfaces, counters), ``host`` / ``device`` / ``tiered`` (feature stores), ``graph``
(the host graph store), ``hotness`` (degree or pre-sampled access counts), ``placement`` (the
solver), ``prefetch`` (gather thread, pinned double buffers, side stream), ``budget`` (the
``store.device_memory`` setting), ``rank`` (one rank's store as the engines build it).
"""
