"""Global accuracies from per-rank counts (:func:`split_counts` on this rank, then
:func:`accuracy_metrics`, one allreduce)."""
from __future__ import annotations

import torch

from hpcgnn.comm.allreduce import allreduce_sum

SPLITS = ("train", "val", "test")


def accuracy_metrics(rt, correct: dict[str, int], total: dict[str, int]) -> dict[str, float]:
    """Collective: ``{split}_acc`` = sum of correct / sum of total over ranks (NaN if empty)."""
    names = sorted(correct)
    sums = allreduce_sum(rt, [correct[n] for n in names] + [total[n] for n in names])
    k = len(names)
    return {f"{n}_acc": (sums[i] / sums[k + i] if sums[k + i] > 0 else float("nan"))
            for i, n in enumerate(names)}


def split_counts(pred: torch.Tensor, labels: torch.Tensor, masks: dict[str, torch.Tensor]):
    """(correct, total) per split of predictions on this rank's vertices."""
    hit = pred == labels
    correct = {k: int(hit[m].sum()) for k, m in masks.items()}
    total = {k: int(m.sum()) for k, m in masks.items()}
    return correct, total
