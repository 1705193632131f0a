"""Torch-free descriptions of the training engines (one module each; see
:mod:`hpcgnn.engine.registry`)."""
