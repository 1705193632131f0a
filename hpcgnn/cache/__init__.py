"""Caches of remote rows, one module per cache (the exchanges that fill them are in comm/):

* :mod:`hpcgnn.cache.hec`: DistGNN-MB's historical embedding cache (per layer input, FIFO lines
  with an age bound), filled by the asynchronous embedding push (:mod:`hpcgnn.comm.aep`);
* :mod:`hpcgnn.cache.halo`: CaPGNN's two-tier (device, host) halo cache with frozen admission
  by duplication count, filled by the staleness-bounded exchange (:mod:`hpcgnn.comm.halo_cached`).
"""
