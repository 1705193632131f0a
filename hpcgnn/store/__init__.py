"""XGNN-style feature and topology store over device and host memory (docs/store.md).

``base`` (interfaces, counters), ``host`` / ``device`` / ``tiered`` (feature stores), ``graph``
(the host graph store), ``hotness`` (degree or pre-sampled access counts), ``placement`` (the
solver), ``prefetch`` (gather thread, pinned double buffers, side stream), ``budget`` (the
``store.device_memory`` setting), ``rank`` (one rank's store as the minibatch engine uses it).
"""
