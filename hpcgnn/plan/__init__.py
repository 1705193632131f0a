"""`hpcgnn plan`: choose an engine and its settings for a partition store and a machine.

Structured like torchrec's planner, one job per module:

* :mod:`hpcgnn.plan.topology`  - the machine: ranks, ranks per node, host and device memory
* :mod:`hpcgnn.plan.calibrate` - the micro-benchmark of this machine's rates, cached per host
* :mod:`hpcgnn.plan.proposer`  - the candidate settings (one variant generator per engine)
* :mod:`hpcgnn.plan.estimator` - per-rank peak memory, bytes and predicted epoch time per candidate
* :mod:`hpcgnn.plan.planner`   - fit checks, ranking, the table of why and the recommended TOML

The command is :mod:`hpcgnn.commands.plan`; docs/plan.md describes the cost model.
"""
