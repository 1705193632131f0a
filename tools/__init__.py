"""Lab tooling run from a checkout (not part of the installed package): ``make check-gpu``'s
driver (gpu_check.py), ``make check-gpu-all``'s session (gpu_session.py) and the offline wheels
for a GPU machine's venv (gpu_wheels.py). Tools import :mod:`benchmarks` and :mod:`hpcgnn`;
neither imports them (tests/test_layers.py checks it)."""
