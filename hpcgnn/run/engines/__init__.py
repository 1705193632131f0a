"""The training engines' config sections, torch-free: :mod:`~hpcgnn.run.engines.registry` and
one spec module per engine (``minibatch``, ``fullgraph``, ``tensor``). The engines themselves
are in :mod:`hpcgnn.engine`, imported only when a run starts."""
