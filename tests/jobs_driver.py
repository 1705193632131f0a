"""Runs several `hpcgnn train` / `hpcgnn infer` jobs one after the other in ONE mpiexec launch,
each with its own Runtime, started and finished as the command does (torch.distributed is
brought up and torn down per job), so that a test module pays one launch (one import of torch
per rank, 3 s of CPU each on a 2-core machine) per rank count instead of one per job.
Argument: a JSON file with a list of jobs (written by :func:`mpiutil.run_jobs`), each
``{"kind": "train", "config": PATH, "set": [...], "verbose": bool, "resume": bool, "expect": int}``
(``resume``: ``--resume`` instead of ``--force``; ``expect``: the exit code it should end with,
default 0, e.g. 75 for a run a stop signal ends) or ``{"kind": "infer", "run": DIR, "out": FILE}``.
The first job that ends otherwise ends the launch with its exit code (1 for an unexpected 0); the
jobs before it have finished (their run directories are complete)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from hpcgnn.commands.infer import _infer
from hpcgnn.commands.train import _train


def main() -> int:
    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs:
        if job["kind"] == "train":
            resume = bool(job.get("resume", False))
            args = argparse.Namespace(config=job["config"], set=list(job["set"]), resume=resume,
                                      force=not resume, verbose=bool(job.get("verbose", False)))
            saved = {k: os.environ.get(k) for k in job.get("env", {})}
            os.environ.update(job.get("env", {}))
            try:
                rc = _train(args)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        else:
            args = argparse.Namespace(run=job["run"], out=job["out"], checkpoint=None, what="logits", layer=None,
                                      partitions=None, device=None, backend=None, block_bytes="64MiB", force=True,
                                      verbose=False)
            rc = _infer(args)
        expect = int(job.get("expect", 0))
        if rc != expect:
            return rc or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
