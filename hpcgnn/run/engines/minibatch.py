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
    "eval": Key(str, "full", "evaluation: 'full' (layer-wise, all neighbours) or 'sampled'",
                choices=("full", "sampled")),
    "eval_rows": Key(int, 0, "full evaluation: destination rows per chunk (0 = as many as keep "
                     "one chunk's temporaries within 256 MiB)", nonneg, ">= 0"),
    "eval_halo_rounds": Key(int, 0, "full evaluation: halo exchanges per layer, each with a part of "
                            "the halo rows (0 = as many as keep one round within 256 MiB)",
                            nonneg, ">= 0"),
    "halo": Key(str, "hec", "halo neighbours: 'hec' (historical embeddings + AEP), 'off' "
                "(dropped), 'exact' (fetched synchronously each minibatch)",
                choices=("hec", "off", "exact")),
    "delay": Key(int, 1, "AEP delay d in iterations", positive, ">= 1"),
    "nc": Key(int, 2000, "AEP: most vertices pushed per destination per layer per iteration",
              positive, "> 0"),
    "cs": Key(int, 1_000_000, "HEC lines per layer (at most; a cache holds min(cs, the rank's halo "
              "vertices) lines and grows to that as rows arrive)", positive, "> 0"),
    "ls": Key(int, 2, "HEC life span in receive steps (layers > 0)", nonneg, ">= 0"),
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
    memory_terms="hpcgnn.engine.estimate:minibatch_terms",
    validate=validate,
    safe_on_resume=("minibatch.eval", "minibatch.eval_rows", "minibatch.eval_halo_rounds",
                    # the store changes where rows live, never their values (docs/store.md)
                    "store.device_memory", "store.hotness", "store.presample", "store.overlap"),
)
