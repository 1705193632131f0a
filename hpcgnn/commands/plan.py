"""`hpcgnn plan STORE --config FILE [--ranks N] [--host-memory 24GiB] [--device-memory 80GiB]
[--out recommended.toml]`: predict every engine setting's per-rank memory and epoch time for a
partition store on this machine, reject what does not fit, rank the rest and write the best
one's configuration (docs/plan.md).

Reads the store's metadata and partition sizes (no vertex data). The rates come from a
calibration file keyed by host name (measured once, ~15 s; ``--recalibrate`` measures again).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hpcgnn.errors import InputError


EXAMPLES = """examples:
  hpcgnn plan data/cora-metis-2 --config inputs/cora-sage.toml
  hpcgnn plan data/big-metis-8 --config my.toml --host-memory 256GiB --out recommended.toml
  hpcgnn plan data/big-metis-8 --config my.toml --device cuda --device-memory 80GiB
(docs/choosing-an-engine.md)
"""


def add_arguments(parser) -> None:
    parser.add_argument("store", metavar="STORE", help="partition directory written by `hpcgnn partition`")
    parser.add_argument("--config", required=True, metavar="FILE", help="training configuration (TOML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration key (repeatable)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="MPI ranks of the run (default: the store's partition count)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks sharing one node (default: all of them, one machine)")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="memory of one node, e.g. 24GiB (default: what this machine has available)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="compute device (default: train.device of the config; 'auto' counts as cpu)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="memory of one GPU with --device cuda (default 80GiB)")
    parser.add_argument("--chunks", default="2,4,8,16", metavar="K,K,...",
                        help="chunk counts tried for offloaded full-graph training")
    parser.add_argument("--engines", default=None, metavar="NAME,...",
                        help="only these engines (default: every registered one)")
    parser.add_argument("--any-model", action="store_true",
                        help="the recommendation may train another model than the configured one "
                             "(the decoupled tensor mode); listed and ranked either way")
    parser.add_argument("--calibration", default=None, metavar="FILE.json",
                        help="calibration file (default $HPCGNN_CALIBRATION or ~/.cache/hpcgnn/calibration.json)")
    parser.add_argument("--recalibrate", action="store_true", help="measure this machine again")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="fail instead of measuring when the calibration file has no entry for this host")
    parser.add_argument("--out", default=None, metavar="FILE.toml", help="write the recommended configuration")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _chunks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks):
        raise InputError(f"--chunks {text!r}: expected a comma-separated list of positive integers")
    return ks


def run(args) -> int:
    from hpcgnn.partition.store import META_FILE, read_meta
    from hpcgnn.plan.calibrate import Calibration, default_path, load_or_measure, read_file
    from hpcgnn.plan.planner import make_plan, table, to_json, write_recommended
    from hpcgnn.plan.topology import build_topology
    from hpcgnn.run.config import load_config

    store = Path(args.store)
    if not (store / META_FILE).exists():
        raise InputError(f"{store}: not a partition directory (no {META_FILE}); expected the output of "
                         "`hpcgnn partition`")
    meta = read_meta(store)
    chunks = _chunks(args.chunks)
    engines = [e for e in args.engines.split(",") if e] if args.engines else None
    cfg = load_config(args.config, [*args.set, f"data.partitions={store}"])
    device = args.device or ("cuda" if cfg.train.device == "cuda" else "cpu")
    if args.device_memory and device != "cuda":
        raise InputError(f"--device-memory {args.device_memory}: needs --device cuda (or train.device = 'cuda')")
    topo = build_topology(args.ranks if args.ranks is not None else meta.num_parts, args.ranks_per_node,
                          args.host_memory, device, args.device_memory)
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    if args.no_calibrate:
        import socket

        path = Path(args.calibration) if args.calibration else default_path()
        hosts = read_file(path)
        if socket.gethostname() not in hosts:
            raise InputError(f"{path}: no calibration for host {socket.gethostname()!r} (--no-calibrate)")
        cal = Calibration.from_json(hosts[socket.gethostname()], str(path))
    else:
        cal = load_or_measure(Path(args.calibration) if args.calibration else None, args.recalibrate, log)
    plan = make_plan(args.config, args.set, store, topo, cal, chunks, engines, args.any_model)
    d = to_json(plan)
    if args.json:
        d["written"] = str(args.out) if args.out and plan.best else None
        print(json.dumps(d, indent=2, sort_keys=True))
    else:
        print(table(plan))
    sys.stdout.flush()
    if args.out:                   # after the table, so a refusal still shows why
        write_recommended(args.out, plan)
        if not args.json:
            print(f"wrote {args.out}")
    return 0
