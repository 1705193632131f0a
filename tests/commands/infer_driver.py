"""Run several `hpcgnn` commands in one MPI job (one interpreter start for many cases).

    mpiexec -n N python infer_driver.py CASES.json RESULTS.json

CASES.json: a list of ``{"name": str, "args": [str, ...]}``; each case runs
``hpcgnn.cli.main(args)`` on every rank in order (a barrier between cases). A case
``{"name": str, "copy": [SRC, DST]}`` instead copies file SRC to DST on rank 0 (set-up for
later cases, e.g. a run directory without checkpoints). RESULTS.json
(written by rank 0): ``{name: {"rc": [per rank], "stderr": [per rank], "seconds": float}}``:
the exit code (returned or raised as SystemExit) and what the command printed on stderr, per
rank, and rank 0's wall time of the case.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

from mpi4py import MPI

from hpcgnn.cli import main


def run_case(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(rc or 0), err.getvalue()


def drive(cases_path: str, results_path: str) -> None:
    comm = MPI.COMM_WORLD
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        comm.Barrier()
        if "copy" in case:
            if comm.Get_rank() == 0:
                src, dst = map(Path, case["copy"])
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
            continue
        t0 = time.perf_counter()
        rc, err = run_case(case["args"])
        seconds = time.perf_counter() - t0
        got = comm.gather((rc, err), root=0)
        if comm.Get_rank() == 0:
            results[case["name"]] = {"rc": [g[0] for g in got], "stderr": [g[1] for g in got],
                                     "seconds": seconds}
            sys.stderr.write(f"[{case['name']}] rc {[g[0] for g in got]} {seconds:.2f} s\n{got[0][1]}")
    if comm.Get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    drive(sys.argv[1], sys.argv[2])
