"""MPI driver for test_sampled_eval.py: the minibatch engine's sampled evaluation.

usage: sampled_eval_driver.py PARTS CONFIG RUN_ROOT
Builds two engines with the same seed (identical untrained models) and evaluation batches of 4
and 1000 seeds per rank, then checks on every rank: the evaluated vertex set is the validation
and test vertices; predictions do not depend on the batch size nor on whether the training
vertices are evaluated too; after one training epoch, ``evaluate`` reports the val/test
accuracy of those predictions and the train accuracy of the epoch's training minibatches
(every training vertex counted once). Prints ``SAMPLED-EVAL-OK <rank>``.
"""
import sys

import numpy as np
import torch

from hpcgnn.comm.allreduce import allreduce_sum
from hpcgnn.engine.minibatch import MinibatchEngine
from hpcgnn.partition.store import read_meta
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.runtime import Runtime

parts, config, root = sys.argv[1:4]
rt = Runtime.start(threads=1)
with rt.guard():
    meta = read_meta(parts)
    engines = []
    for eb in (4, 1000):
        cfg = load_config(config, [f"data.partitions={parts}", f"output.dir={root}/eb{eb}",
                                   "minibatch.eval=sampled", f"minibatch.eval_batch_size={eb}"])
        engines.append(MinibatchEngine(cfg, rt, RunOutput(cfg.output.dir, rt, cfg, meta, resume=False,
                                                          force=True)))
    small, large = engines
    part = small.part
    evaluated = part.val_mask | part.test_mask
    labelled = np.flatnonzero(part.train_mask | evaluated)
    small.model.eval()
    large.model.eval()
    p_small, p_large = small._predict_sampled(), large._predict_sampled()
    # the previous evaluated set (train, val and test), in batches of 4
    p_all = small._predict_sampled(labelled)
    assert evaluated.any() and part.train_mask.any()
    assert (p_small[torch.from_numpy(~evaluated)] == -1).all(), "a vertex outside val/test evaluated"
    assert (p_small[torch.from_numpy(evaluated)] >= 0).all(), "a val/test vertex not evaluated"
    assert torch.equal(p_small, p_large), "predictions depend on the evaluation batch size"
    ev = torch.from_numpy(evaluated)
    assert torch.equal(p_all[ev], p_small[ev]), "val/test predictions change when train is evaluated too"

    small.model.train()
    result = small.train_epoch(1)
    metrics = small.evaluate()
    small.model.eval()                       # evaluate() leaves the model in training mode
    pred = small._predict_sampled()           # the trained model, another evaluation of it
    labels = small.labels.cpu()
    sums = allreduce_sum(rt, [int((pred == labels)[torch.from_numpy(part.val_mask)].sum()),
                              int(part.val_mask.sum()),
                              int((pred == labels)[torch.from_numpy(part.test_mask)].sum()),
                              int(part.test_mask.sum()), small._train_counts[0], small._train_counts[1],
                              int(part.train_mask.sum())])
    assert metrics["val_acc"] == sums[0] / sums[1] and metrics["test_acc"] == sums[2] / sums[3], metrics
    assert sums[5] == sums[6], "train accuracy does not count each training vertex once"
    assert metrics["train_acc"] == sums[4] / sums[5] and 0 < metrics["train_acc"] < 1, metrics
    small.close()
    large.close()
    rt.comm.Barrier()
    print(f"SAMPLED-EVAL-OK {rt.rank}", flush=True)
