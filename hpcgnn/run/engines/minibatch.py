"""The DistGNN-MB minibatch engine: config section ``[minibatch]``."""
from __future__ import annotations

from hpcgnn.errors import InputError
from hpcgnn.run.config import Key, nonneg, positive
from hpcgnn.run.engines.registry import EngineSpec


def _fanouts(x) -> bool:
    return len(x) >= 1 and all(isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v > 0)
                               for v in x)


KEYS = {
    "batch_size": Key(int, 1000, "seed vertices per rank per iteration", positive, "> 0"),
    "fanouts": Key(list, [5, 10, 15], "neighbours sampled per layer, input side first; -1 = all",
                   _fanouts, "a list of positive integers or -1"),
    "eval": Key(str, "full", "evaluation: 'full' (layer-wise, all neighbours, every vertex) or "
                "'sampled' (the training fanouts, validation and test vertices; train accuracy is that "
                "of the epoch's training minibatches, dropout on)",
                choices=("full", "sampled")),
    "eval_batch_size": Key(int, 0, "sampled evaluation: seed vertices per rank per batch (0 = "
                           "batch_size: a batch's fetched input rows grow with it, three hops out); "
                           "the predictions do not depend on it", nonneg, ">= 0"),
    "eval_rows": Key(int, 0, "full evaluation: destination rows per chunk (0 = as many as keep "
                     "one chunk's temporaries within 256 MiB)", nonneg, ">= 0"),
    "eval_halo_rounds": Key(int, 0, "full evaluation: halo exchanges per layer, each with a part of "
                            "the halo rows (0 = as many as keep one round within 256 MiB)",
                            nonneg, ">= 0"),
    "halo": Key(str, "hec", "halo neighbours: 'hec' (historical embeddings + AEP), 'off' "
                "(dropped), 'exact' (fetched synchronously each minibatch)",
                choices=("hec", "off", "exact")),
    "push_delay": Key(int, 1, "AEP: iterations between pushing a solid row and its use by the "
                      "receiving rank's HEC (the paper's d)", positive, ">= 1", aliases=("delay",)),
    "push_limit": Key(int, 2000, "AEP: most solid rows pushed per destination rank per layer per "
                      "iteration (the paper's nc)", positive, "> 0", aliases=("nc",)),
    "cache_lines": Key(int, 1_000_000, "HEC size: lines per layer, at most (a cache holds "
                       "min(cache_lines, the rank's halo vertices) lines and grows to that as rows "
                       "arrive; the paper's cs)", positive, "> 0", aliases=("cs",)),
    "cache_lifespan": Key(int, 2, "HEC: receive steps a cached line stays valid, layers > 0 (the "
                          "paper's ls)", nonneg, ">= 0", aliases=("ls",)),
    "reset_cache_each_epoch": Key(bool, True, "clear the HECs at the start of every epoch"),
}


def validate(cfg, label: str) -> None:
    """One fanout per layer."""
    fanouts, layers = cfg.minibatch.fanouts, cfg.model.layers
    if len(fanouts) != layers:
        raise InputError(f"{label}: minibatch.fanouts has {len(fanouts)} entries but model.layers = "
                         f"{layers} (one fanout per layer)")


SPEC = EngineSpec(
    name="minibatch",
    summary="DistGNN-MB: local neighbour sampling, historical embedding cache, asynchronous push",
    section="minibatch",
    keys=KEYS,
    factory="hpcgnn.engine.minibatch:make_engine",
    memory_terms="hpcgnn.engine.memory_minibatch:minibatch_terms",
    validate=validate,
    safe_on_resume=("minibatch.eval", "minibatch.eval_batch_size", "minibatch.eval_rows", "minibatch.eval_halo_rounds",
                    # the store changes where rows live, never their values (docs/store.md)
                    "store.device_memory", "store.hotness", "store.presample", "store.overlap"),
)
