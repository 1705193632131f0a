"""What ``hpcgnn train --resume`` checks before it continues a run: the run file's store, ranks and
engine (:func:`check_run`), the settings against the run's (:func:`check_settings`: a changed setting
outside :func:`safe_on_resume` is refused with one line naming each such setting with its old and
new value; changed safe settings are accepted with one warning line) and the newest checkpoint
against the run (:func:`check_checkpoint`). A run without a checkpoint starts again at epoch 1
(one line says so, settings are not compared). See docs/runs.md.
"""
from __future__ import annotations

import json
from pathlib import Path

from hpcgnn.errors import InputError
from hpcgnn.run.console import warn
from hpcgnn.run.runfile import CHECKPOINT_DIR, RUN_FILE

# Settings --resume may change (a warning names each change); a change of any other setting
# (learning rate, seed, model shape, halo mode, batch size, fanouts, ...) is refused, because the
# continued run would no longer be the run its checkpoint belongs to. These change how long the
# run goes, what is evaluated and recorded, and where and how fast it runs; device, threads and
# backend may change results in the last bits (floating-point order), nothing more.
SAFE_ON_RESUME = (
    "data.partitions",        # the store's content hash must still be the run's
    "data.verify",
    "train.epochs", "train.eval_every", "train.checkpoint_every", "train.device", "train.stop_signals",
    "train.kernels", "train.deterministic",
    "output.dir", "output.keep_checkpoints", "output.flush_seconds",
    "runtime.threads", "runtime.backend", "runtime.memory_check", "runtime.memory_limit",
    "runtime.device_memory_limit",
    "runtime.host_memory",    # where freed pages go; no value changes (tests/runtime/test_host_memory.py)
)


def safe_on_resume() -> tuple[str, ...]:
    """:data:`SAFE_ON_RESUME` and the keys each engine declares safe (its spec's)."""
    from hpcgnn.run.engines.registry import engine_specs

    return SAFE_ON_RESUME + tuple(k for spec in engine_specs() for k in spec.safe_on_resume)


def safe_on_resume() -> tuple[str, ...]:
    """:data:`SAFE_ON_RESUME` and the keys each engine declares safe (its spec's)."""
    from hpcgnn.run.engines.registry import engine_specs

    return SAFE_ON_RESUME + tuple(k for spec in engine_specs() for k in spec.safe_on_resume)


def _setting(value) -> str:
    return json.dumps(value)


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every schema setting that differs; a key missing
    from ``old`` (a run file from before the key existed) counts as its default."""
    from hpcgnn.run.config import canonical_names, schema

    old, new = canonical_names(old), canonical_names(new)
    changes = []
    for section, keys in schema().items():
        for key, spec in keys.items():
            before = (old.get(section) or {}).get(key, spec.default)
            after = (new.get(section) or {}).get(key, spec.default)
            if before != after:
                changes.append((f"{section}.{key}", before, after))
    return changes


def check_run(run_file: Path, attrs: dict, content_hash: str, size: int, engine: str) -> None:
    """Refuse (InputError) to resume the run of ``run_file`` (its attributes ``attrs``) on another
    partition store (``content_hash``), another number of ranks or another engine."""
    a = attrs
    if a.get("partition_hash") != content_hash:
        raise InputError(f"{run_file}: run was made on partition store "
                         f"{str(a.get('partition_hash'))[:12]}..., data.partitions is "
                         f"{content_hash[:12]}...; cannot resume")
    if int(a.get("num_ranks", -1)) != size:
        raise InputError(f"{run_file}: run used {a.get('num_ranks')} ranks, "
                         f"this job has {size}; cannot resume")
    if a.get("engine") != engine:
        raise InputError(f"{run_file}: run used engine {a.get('engine')!r}, "
                         f"config says {engine!r}; cannot resume")


def check_settings(run_dir: Path, attrs: dict, cfg, content_hash: str, run_id: str | None,
                   engine: str) -> dict | None:
    """Refuse (InputError) or warn about settings changed since the run in ``run_dir`` started
    (its run file's attributes ``attrs``), then check its newest checkpoint
    (:func:`check_checkpoint`): the checkpoint to resume from, None where there is none."""
    from hpcgnn.run.checkpoint import list_checkpoints

    run_file = run_dir / RUN_FILE
    if not list_checkpoints(run_dir):
        warn(f"--resume: {run_dir} has no checkpoint yet: the run starts again at epoch 1")
        return None
    try:
        old = json.loads(attrs.get("config") or "{}")
    except json.JSONDecodeError:
        raise InputError(f"{run_file}: attribute 'config' is not JSON; cannot check the "
                         "settings to resume (pass --force to start a new run)") from None
    changes = config_changes(old, cfg.to_dict())
    safe = safe_on_resume()
    unsafe = [c for c in changes if c[0] not in safe]
    if unsafe:
        listed = ", ".join(f"{k} {_setting(a)} -> {_setting(b)}" for k, a, b in unsafe)
        raise InputError(f"{run_file}: cannot resume with changed settings: {listed} (resume "
                         "with the run's values, or start a new run with --force; "
                         "docs/runs.md lists what may change)")
    state = check_checkpoint(run_dir, cfg, content_hash, run_id, engine, safe)
    if changes:
        listed = ", ".join(f"{k} {_setting(a)} -> {_setting(b)}" for k, a, b in changes)
        warn(f"--resume with changed settings (safe to change): {listed}")
    return state


def check_checkpoint(run_dir: Path, cfg, content_hash: str, run_id: str | None, engine: str,
                     safe) -> dict | None:
    """The newest readable checkpoint of ``run_dir`` (None where there is none), refused
    (InputError) when it is not this run's: another run's identity (``run_id``), another engine
    or store, or settings outside ``safe`` that differ from ``cfg``; and a run whose newest
    checkpoint is past ``train.epochs`` (nothing would be trained)."""
    from hpcgnn.run.checkpoint import load_latest_checkpoint

    state = load_latest_checkpoint(run_dir, content_hash)
    if state is None:
        return None
    where = f"{run_dir / CHECKPOINT_DIR}/ckpt-{int(state['epoch']):06d}.pt"
    if state.get("run_id") and run_id and state["run_id"] != run_id:
        raise InputError(f"{where}: checkpoint belongs to another run (run_id "
                         f"{str(state['run_id'])[:12]}..., this run's is {str(run_id)[:12]}...); "
                         "cannot resume (pass --force to start a new run)")
    if state.get("engine", engine) != engine:
        raise InputError(f"{where}: checkpoint was written by engine {state.get('engine')!r}, "
                         f"config says {engine!r}; cannot resume")
    try:
        theirs = json.loads(state.get("config") or "{}")
    except (TypeError, json.JSONDecodeError):
        theirs = {}
    if theirs:
        unsafe = [c for c in config_changes(theirs, cfg.to_dict()) if c[0] not in safe]
        if unsafe:
            listed = ", ".join(f"{k} {_setting(a)} -> {_setting(b)}" for k, a, b in unsafe)
            raise InputError(f"{where}: checkpoint was written with other settings than this "
                             f"run's ({listed}): it belongs to another run; cannot resume "
                             "(pass --force to start a new run)")
    epoch, epochs = int(state["epoch"]), int(cfg.train.epochs)
    if epoch > epochs:
        raise InputError(f"{where}: the run is at epoch {epoch} but train.epochs = {epochs}: "
                         f"nothing to train (to continue, set train.epochs above {epoch})")
    if epoch == epochs:
        warn(f"--resume: {run_dir} is already at epoch {epoch} = train.epochs: nothing "
             "to train")
    return state
