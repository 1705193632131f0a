"""The ``make bench-*`` benchmarks and the peer comparisons, run from a checkout as
``python -m benchmarks.NAME`` (not part of the installed package). They import :mod:`hpcgnn`;
hpcgnn never imports them (tests/test_layers.py checks both)."""
