"""MPI driver for test_tensor_precision.py: one training epoch of the tensor engine under a
torch dispatch mode that records every matrix product (aten mm / addmm / bmm / addmv / mv)
with the dtypes of its tensor operands; rank 0 writes all ranks' records as JSON.

usage: tensor_precision_driver.py PARTS CONFIG RUN_DIR OUT_JSON [KEY=VALUE ...]
"""
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpcgnn.engine.tensor import TensorEngine
from hpcgnn.partition.store import read_meta
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.runtime import Runtime

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "matmul", "linear", "dot"}


class RecordProducts(TorchDispatchMode):
    """Records (op name, [dtype of each tensor operand]) of every product dispatched."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            self.calls.append([name, [str(a.dtype) for a in args if isinstance(a, torch.Tensor)]])
        return func(*args, **(kwargs or {}))


parts, config, run_dir, out_json = sys.argv[1:5]
rt = Runtime.start(threads=1)
with rt.guard():
    meta = read_meta(parts)
    cfg = load_config(config, [f"data.partitions={parts}", f"output.dir={run_dir}", *sys.argv[5:]])
    out = RunOutput(cfg.output.dir, rt, cfg, meta, resume=False, force=True)
    engine = TensorEngine(cfg, rt, out)
    with RecordProducts() as rec:
        engine.train_epoch(1)
    got = rt.comm.gather(rec.calls, root=0)
    if rt.is_root:
        with open(out_json, "w") as f:
            json.dump(got, f)
    rt.comm.Barrier()
