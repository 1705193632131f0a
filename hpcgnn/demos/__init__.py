"""Tiny MPI programs for checking a launch and the runtime (run them under mpiexec or srun).

    mpiexec -n 2 python -m hpcgnn.demos.hello       one line per rank: rank, size, threads, host
    mpiexec -n 2 python -m hpcgnn.demos.exchange    alltoallv / Ialltoallv / torch all_to_all_single
    mpiexec -n 2 python -m hpcgnn.demos.fail --rank 1 --mode raise
                                                    the failure policy: the whole job ends
"""
