"""MPI driver for test_store_engines.py: one launch, one short Cora training per engine and
store budget.

usage: store_engines_driver.py PARTS RUN_ROOT CONFIG
Runs ``hpcgnn train`` for every engine of ENGINES with store.device_memory = 0 (host-only) and
0.2 (tiered) into RUN_ROOT/<engine>-<budget>.
"""
import sys

from hpcgnn.cli import main

ENGINES = {
    "fullgraph": ["train.engine=fullgraph"],
    "offload": ["train.engine=fullgraph", "fullgraph.offload=true", "fullgraph.chunks=3",
                "fullgraph.recompute=recompute"],
    "tensor": ["train.engine=tensor", "model.arch=gcn"],
    "exact": ["minibatch.halo=exact"],
}
BUDGETS = ("0", "0.2")

parts, root, config = sys.argv[1:4]
for engine, sets in ENGINES.items():
    for budget in BUDGETS:
        args = ["train", "--config", config, "--set", f"data.partitions={parts}",
                "--set", f"output.dir={root}/{engine}-{budget}", "--set", f"store.device_memory={budget}",
                "--set", "model.dropout=0", "--set", "train.epochs=3", "--set", "train.eval_every=3",
                "--set", "train.checkpoint_every=0", "--force"]
        for s in sets:
            args += ["--set", s]
        rc = main(args)
        if rc != 0:
            raise SystemExit(rc)
