"""`hpcgnn train --config FILE [--set key=value]... [--resume] [--force]` (run under mpiexec/srun).

Every rank loads the configuration and its own partition (rank r reads partition r of
``data.partitions``); the job must have exactly as many ranks as the store has partitions.
Checks whose outcome may differ between ranks go through ``Runtime.agree`` so that every rank
stops with the same one-line error and exit code 2. ``train.engine`` names an engine of
:mod:`hpcgnn.run.engines.registry`, whose factory builds the rank's
:class:`~hpcgnn.engine.loop.Engine`; :func:`hpcgnn.engine.loop.fit` runs the epochs. The rank runs in a child of a small watcher
process that names the rank if a signal (the OOM killer's SIGKILL) ends it
(:mod:`hpcgnn.supervisor`). A stop signal (``train.stop_signals``: a batch system's time limit,
``--signal`` or preemption) ends the run after the epoch in progress with its checkpoint and exit
status 75 (:mod:`hpcgnn.run.stop`); ``--resume`` continues it.

Rank 0 prints (:mod:`hpcgnn.run.console`) a start banner once the engine is built, one line per
epoch (``hpcgnn -v``: and its phases), a heartbeat on stderr while set-up or an epoch runs long,
and a summary at the end, also of a run that a stop signal ended or that failed.
"""
from __future__ import annotations

import time

from hpcgnn.run.stop import EXIT_STOPPED


EXAMPLES = """examples:
  mpiexec -n 2 python -m hpcgnn train --config inputs/cora-sage.toml \\
      --set data.partitions=data/cora-metis-2 --set output.dir=runs/cora
  mpiexec -n 2 python -m hpcgnn train --config inputs/cora-sage.toml --set output.dir=runs/cora --resume
  python -m hpcgnn train --config inputs/cora-gcn-fullgraph.toml --set train.epochs=5   # one rank
(every key: hpcgnn config; docs/cluster.md, docs/runs.md)
"""


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="TOML configuration file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration key, e.g. --set train.epochs=5 (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in output.dir from its latest checkpoint")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing run in output.dir")


def run(args) -> int:
    from hpcgnn.supervisor import run_watched

    return run_watched(lambda: _train(args))


def verbose(args) -> bool:
    """Whether the command runs with ``hpcgnn -v`` (its ``args.verbose``, or a ``hpcgnn`` logger
    set to show debug records)."""
    from hpcgnn import log

    return bool(getattr(args, "verbose", 0)) or log.verbose()


def say_data_plane(rt, args) -> None:
    """``hpcgnn -v`` (rank 0): one line naming what carries the data plane
    (``Runtime.data_plane``, made by the engine from ``runtime.backend``) and the MPI library of
    the job."""
    from hpcgnn import log
    from hpcgnn.runtime import mpi_library

    if not (rt.is_root and verbose(args)):
        return
    plane = getattr(rt, "data_plane", None)
    log.info(f"hpcgnn: data plane {plane.name if plane is not None else 'none (the engine made none)'} "
              f"on {rt.size} rank(s); MPI library {mpi_library()}")


def _train(args) -> int:
    from hpcgnn.run.config import load_config
    from hpcgnn.run.stop import StopRequest
    from hpcgnn.runtime import Runtime

    rt = Runtime.start()
    with rt.guard():
        cfg = rt.agree_on(lambda: load_config(args.config, args.set))
        with StopRequest(cfg.train.stop_signals) as stop:    # the old handlers back afterwards
            return _train_with(args, rt, cfg, stop)


def _train_with(args, rt, cfg, stop) -> int:
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import check_backend
    from hpcgnn.run.output import RunOutput

    rt.agree_on(lambda: check_backend(cfg))   # nccl on the CPU, ccl absent: one line, exit 2
    rt.apply_settings(cfg.runtime)
    meta = rt.agree_on(lambda: read_meta(cfg.data.partitions))
    if meta.num_parts != rt.size:
        rt.agree(f"{cfg.data.partitions}: the partition store has {meta.num_parts} partitions but "
                 f"the job has {rt.size} ranks (start one rank per partition: "
                 f"mpiexec -n {meta.num_parts})")
    from hpcgnn.engine.memory_check import check_device_memory, check_memory, estimate_attrs

    host_est = check_memory(cfg, meta, rt)   # refuses (exit 2 everywhere) what is clearly over
    dev_est = check_device_memory(cfg, meta, rt)   # the device's: refused before the first epoch
    out = RunOutput(cfg.output.dir, rt, cfg, meta, resume=args.resume, force=args.force)
    out.set_attrs(rank_threads=rt.comm.allgather(rt.threads),   # per rank, as they ran
                  **estimate_attrs(rt, host_est, dev_est))     # the estimates, beside the measured peaks
    from hpcgnn.engine.hooks import make_hooks
    from hpcgnn.engine.loop import fit
    from hpcgnn.progress import fmt_seconds
    from hpcgnn.run.console import LABEL, RunConsole, first_epoch
    from hpcgnn.run.engines.registry import engine_spec, resolve

    console = RunConsole(cfg, rt, out, verbose=verbose(args))
    rt.on_failure(console.failed)       # after the run file's own hook: the file says failed first
    from hpcgnn.engine.memory_check import FirstStepCheck

    # the measured first step stops (exit 2 everywhere) what the estimate left open
    hooks = FirstStepCheck(make_hooks(cfg, rt, out), cfg, rt, host_est, dev_est)
    with console.setup_step(f"setting up the {cfg.train.engine} engine"):
        engine = resolve(engine_spec(cfg.train.engine).factory)(cfg, rt, out, hooks)
    hooks.attach(engine)
    say_data_plane(rt, args)
    console.banner(meta, engine.model)
    first = first_epoch(out) if rt.is_root else 1
    t0 = time.perf_counter()
    stopped = fit(engine, cfg, rt, out, hooks, stop, console)
    seconds = time.perf_counter() - t0
    out.close(stopped_by=stopped.reason if stopped else None)
    rt.remove_failure_hook(console.failed)
    rt.finish()
    if stopped is None:
        epochs = int(cfg.train.epochs)
        trained = "no epoch" if first > epochs else \
            f"epoch {first}" if first == epochs else f"epochs {first}-{epochs}"
        console.summary(f"{'finished':<{LABEL}}all {epochs} epochs; this job trained {trained} in "
                        f"{fmt_seconds(seconds)}")
        return 0
    console.summary(stop_message(stopped, cfg, out.run_dir))
    return EXIT_STOPPED


def stop_message(stopped, cfg, run_dir) -> str:
    """The line rank 0 prints when a stop signal ended the run (:class:`~hpcgnn.engine.loop.Stopped`)."""
    from hpcgnn.run.checkpoint import checkpoint_path

    if stopped.epoch == 0:
        kept = "no epoch was trained, no checkpoint written"
    else:
        kept = f"checkpoint {checkpoint_path(run_dir, stopped.epoch)}"
    return (f"hpcgnn: stopped after epoch {stopped.epoch} of {cfg.train.epochs} ({stopped.reason}): "
            f"{kept}; continue with hpcgnn train --resume (exit status {EXIT_STOPPED})")
