"""A tiny MPI program for checking a launch and the runtime (run it under mpiexec or srun).

    mpiexec -n 2 python -m hpcgnn.demos.hello       one line per rank: rank, size, threads, host

The test suite's own MPI programs (exchanges, the failure policy) are in tests/demos/.
"""
