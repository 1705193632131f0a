"""MPI driver for test_rank_memory.py: trains the minibatch engine and, when the engine closes,
lists every numpy array and torch tensor reachable from it (its attributes, recursively).

usage: rank_arrays_driver.py PARTS RUN_DIR OUT_JSON_PREFIX [KEY=VALUE ...]
Writes OUT_JSON_PREFIX-<rank>.json: {"arrays": [[path, shape, nbytes], ...], "num_local": n,
"num_edges": E_p}.
"""
import json
import sys
import types

import numpy as np
import torch

from hpcgnn.cli import main
from hpcgnn.engine import minibatch

parts, run_dir, prefix, *sets = sys.argv[1:]
SKIP = (types.ModuleType, types.FunctionType, types.MethodType, type, str, bytes, int, float, bool)


def reachable_arrays(root) -> list:
    """[path, shape, nbytes] of every ndarray / tensor reachable through attributes, dicts,
    lists, tuples and sets (each object visited once)."""
    seen, out, stack = set(), [], [("engine", root)]
    while stack:
        path, obj = stack.pop()
        if obj is None or isinstance(obj, SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            out.append([path, list(obj.shape), int(obj.nbytes)])
            continue
        if isinstance(obj, torch.Tensor):
            out.append([path, list(obj.shape), int(obj.numel() * obj.element_size())])
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend((f"{path}.{k}", v) for k, v in attrs.items())
            for k in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, k):
                    stack.append((f"{path}.{k}", getattr(obj, k)))
    return out


close = minibatch.MinibatchEngine.close


def listing_close(self):
    found = {"arrays": reachable_arrays(self), "num_local": int(self.part.num_local),
             "num_edges": int(self.part.indices.shape[0])}
    with open(f"{prefix}-{self.rt.rank}.json", "w") as f:
        json.dump(found, f)
    close(self)


minibatch.MinibatchEngine.close = listing_close
args = ["train", "--config", "inputs/cora-sage.toml", "--set", f"data.partitions={parts}",
        "--set", f"output.dir={run_dir}", "--force"]
for kv in sets:
    args += ["--set", kv]
raise SystemExit(main(args))
