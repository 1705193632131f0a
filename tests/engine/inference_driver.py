"""MPI driver for test_inference_mpi.py: the minibatch engine's full-neighbour inference of an
untrained (seeded, identical) model, gathered on rank 0 in original vertex order.

usage: inference_driver.py PARTS CONFIG ARCHS OUT_PREFIX[|KEY=VALUE...] ...
(ARCHS comma-separated; for each OUT_PREFIX with its settings, writes OUT_PREFIX-<arch>.npy for
each arch, and its run directory OUT_PREFIX-<arch>-run: several settings share one launch)
"""
import sys

import numpy as np

from hpcgnn.engine.minibatch import MinibatchEngine
from hpcgnn.partition.store import read_meta
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.runtime import Runtime

parts, config, archs = sys.argv[1:4]
rt = Runtime.start(threads=1)
with rt.guard():
    meta = read_meta(parts)
    for out_prefix, *sets in (spec.split("|") for spec in sys.argv[4:]):
        for arch in archs.split(","):
            cfg = load_config(config, [f"data.partitions={parts}", f"output.dir={out_prefix}-{arch}-run",
                                       f"model.arch={arch}", *sets])
            out_path = f"{out_prefix}-{arch}.npy"
            out = RunOutput(cfg.output.dir, rt, cfg, meta, resume=False, force=True)
            trainer = MinibatchEngine(cfg, rt, out)
            logits = trainer.infer_full().numpy()
            ids = trainer.part.to_global(np.arange(trainer.part.num_solid))
            got = rt.comm.gather((ids, logits), root=0)
            if rt.is_root:
                order = meta.new_to_orig()
                full = np.zeros((meta.num_nodes, logits.shape[1]), np.float32)
                for i, lg in got:
                    full[order[i]] = lg
                np.save(out_path, full)
            rt.comm.Barrier()
