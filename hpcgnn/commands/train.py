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
"""
from __future__ import annotations

from hpcgnn.run.stop import EXIT_STOPPED


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


def say_data_plane(rt) -> None:
    """``hpcgnn -v``: one line naming what carries the data plane (``Runtime.data_plane``, made by
    the engine from ``runtime.backend``) and the MPI library of the job."""
    from hpcgnn.runtime import mpi_library

    plane = getattr(rt, "data_plane", None)
    print(f"hpcgnn: data plane {plane.name if plane is not None else 'none (the engine made none)'} "
          f"on {rt.size} rank(s); MPI library {mpi_library()}", flush=True)


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
    from hpcgnn.engine.estimate import check_memory

    host_est = check_memory(cfg, meta, rt)   # refuses (exit 2 everywhere) what cannot fit
    from hpcgnn.engine.estimate import check_device_memory, estimate_attrs

    dev_est = check_device_memory(cfg, meta, rt)   # the device's memory: refused before the first epoch
    out = RunOutput(cfg.output.dir, rt, cfg, meta, resume=args.resume, force=args.force)
    out.set_attrs(rank_threads=rt.comm.allgather(rt.threads),   # per rank, as they ran
                  **estimate_attrs(rt, host_est, dev_est))     # the estimates, beside the measured peaks
    from hpcgnn.engine.hooks import make_hooks
    from hpcgnn.engine.loop import fit
    from hpcgnn.run.engines.registry import engine_spec, resolve

    hooks = make_hooks(cfg, rt, out)
    engine = resolve(engine_spec(cfg.train.engine).factory)(cfg, rt, out, hooks)
    if getattr(args, "verbose", False) and rt.is_root:
        say_data_plane(rt)
    stopped = fit(engine, cfg, rt, out, hooks, stop)
    out.close(stopped_by=stopped.reason if stopped else None)
    rt.finish()
    if stopped is None:
        return 0
    if rt.is_root:
        print(stop_message(stopped, cfg, out.run_dir), flush=True)
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
