"""MPI driver for test_store_exact.py: one launch, one Cora training per store layout.

usage: store_exact_driver.py PARTS RUN_ROOT CONFIG
Runs ``hpcgnn train`` with store.device_memory = 0 (host-only), 0.2 (tiered, with and without
overlap) and '1GiB' (device-only: everything fits) into RUN_ROOT/<name>.
"""
import sys

from hpcgnn.cli import main

RUNS = {"host": ("0", "true"), "tiered": ("0.2", "true"), "tiered-sync": ("0.2", "false"),
        "device": ("1GiB", "true")}

parts, root, config = sys.argv[1:4]
for name, (budget, overlap) in RUNS.items():
    rc = main(["train", "--config", config, "--set", f"data.partitions={parts}",
               "--set", f"output.dir={root}/{name}", "--set", f"store.device_memory={budget}",
               "--set", f"store.overlap={overlap}", "--set", "model.dropout=0", "--set", "train.epochs=3",
               "--set", "train.eval_every=3", "--set", "train.checkpoint_every=0", "--force"])
    if rc != 0:
        raise SystemExit(rc)
