"""Checkpoints: ``RUN/checkpoints/ckpt-EEEEEE.pt`` (torch.save of a dict), written atomically.

Rank 0 writes a hidden temporary file beside the target, fsyncs it, renames it into place and
fsyncs the directory, so a reader sees either the old set of checkpoints or the new one, never a
partial file: a writer killed mid-write leaves only a ``.ckpt-*.tmp`` file that no reader picks
up (and the next save removes). ``EEEEEE`` is the last completed epoch (1-based).

A state dict holds at least ``epoch`` and ``content_hash`` (the partition store's); engines add
``model``, ``optimizer`` and whatever they need to continue exactly (tensors, numbers, strings,
lists and dicts only: checkpoints are loaded with ``weights_only=True``).
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpcgnn.errors import InputError
from hpcgnn.fileio import write_failure

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^ckpt-(\d{6,})\.pt$")


def checkpoint_path(run_dir, epoch: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"ckpt-{epoch:06d}.pt"


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """(epoch, path) of the complete checkpoints in ``run_dir``, oldest first."""
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecordingWriter:
    """A binary file whose ``write`` remembers the OSError it raised: torch.save reports a failed
    write as its own ``RuntimeError`` ("unexpected pos ..."), the OS reason lost."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def write_checkpoint_file(path: Path, state: dict) -> None:
    """Atomic write of one checkpoint file (tmp + fsync + rename + directory fsync).

    A failed write (a full disk, a lost permission) raises InputError naming the file and the
    OS reason (``... (No space left on device (ENOSPC))``); the temporary is removed and the
    checkpoints written before stay as they were."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            writer = _RecordingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(exc, Exception):
            cause = writer.error if writer is not None and writer.error is not None else exc
            raise write_failure(path, cause) from None
        raise
    _fsync_dir(path.parent)


def save_checkpoint(run_dir, epoch: int, state: dict, rt, keep: int) -> Path:
    """Collective: rank 0 writes ``ckpt-EEEEEE.pt`` atomically and keeps the newest ``keep``.

    Every rank calls it (it ends with a barrier); only rank 0's ``state`` is written.
    """
    path = checkpoint_path(run_dir, epoch)
    error = None
    if rt.is_root:
        try:
            write_checkpoint_file(path, dict(state, epoch=int(epoch)))
            for old_epoch, old in list_checkpoints(run_dir)[:-max(1, int(keep))]:
                old.unlink(missing_ok=True)
            for stale in path.parent.glob(".ckpt-*.tmp"):
                stale.unlink(missing_ok=True)
        except InputError as exc:
            error = str(exc)
        except OSError as exc:
            error = str(write_failure(path.parent, exc, "cannot update"))
    rt.agree(error)   # every rank stops with rank 0's line when the write failed
    return path


def _read(path: Path) -> tuple[bytes, object]:
    """The bytes of checkpoint file ``path`` (read once) and what ``torch.load`` makes of them
    (on the CPU, tensors and plain data only); InputError naming the file when it is missing,
    unreadable or not a loadable torch file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: checkpoint file not found")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: checkpoint not readable ({exc.__class__.__name__})") from None
    try:
        return data, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is bad input
        raise InputError(f"{path}: not a loadable torch checkpoint ({exc.__class__.__name__})") from None


@dataclass
class Checkpoint:
    """The parts of a checkpoint inference uses; ``sha256`` is of the file's bytes."""

    path: Path
    sha256: str
    epoch: int
    engine: str
    content_hash: str
    model: dict = field(repr=False)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and hash one checkpoint file (rank 0); InputError naming the file if it is not a
    readable hpcgnn checkpoint."""
    path = Path(path)
    data, state = _read(path)
    if not isinstance(state, dict) or "epoch" not in state or not isinstance(state.get("model"), dict):
        raise InputError(f"{path}: not an hpcgnn checkpoint (expected a dict with 'epoch' and 'model')")
    return Checkpoint(path=path, sha256=hashlib.sha256(data).hexdigest(), epoch=int(state["epoch"]),
                      engine=str(state.get("engine", "")), content_hash=str(state.get("content_hash", "")),
                      model=state["model"])


def load_latest_checkpoint(run_dir, content_hash: str) -> dict | None:
    """The newest loadable checkpoint's state, or None if there is none.

    InputError if it was written for another partition store (``content_hash`` differs), or if
    there are checkpoints and none of them can be read (resuming would silently start over).
    An unreadable file (which atomic writing should prevent) is skipped with a warning in
    favour of the previous one.
    """
    found = list_checkpoints(run_dir)
    for epoch, path in reversed(found):
        try:
            _, state = _read(path)
        except InputError as exc:   # any unreadable file: fall back to an older one
            print(f"hpcgnn: warning: {exc}; skipped", file=sys.stderr, flush=True)
            continue
        if not isinstance(state, dict) or "epoch" not in state:
            print(f"hpcgnn: warning: {path}: not an hpcgnn checkpoint, skipped",
                  file=sys.stderr, flush=True)
            continue
        got = state.get("content_hash")
        if got != content_hash:
            raise InputError(f"{path}: checkpoint was written for partition store "
                             f"{str(got)[:12]}..., data.partitions is {content_hash[:12]}...")
        return state
    if found:
        raise InputError(f"{Path(run_dir) / CHECKPOINT_DIR}: none of the {len(found)} checkpoint(s) "
                         "can be read, so the run cannot be continued (pass --force instead of "
                         "--resume to start it over)")
    return None


def load_model_state(model, state: dict, where, cfg) -> None:
    """``model.load_state_dict(state)`` (strict); a checkpoint of another model shape is an
    InputError naming ``where`` (the checkpoint), the model settings and the first mismatch."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = lines[1] if len(lines) > 1 else (lines[0] if lines else "")
        m = cfg.model
        raise InputError(f"{where}: checkpoint does not fit the run's model (model.arch={m.arch}, "
                         f"layers={m.layers}, hidden={m.hidden}): {detail[:300]}") from None


# ---- training state: what the loop saves and restores ---------------------------------------


def save_training_state(out, epoch: int, model: torch.nn.Module, optimizer,
                        extra: dict | None = None) -> None:
    """Collective: checkpoint model, optimizer, torch RNG and ``extra`` after ``epoch`` (1-based)."""
    state = {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "content_hash": out.meta.content_hash,
        "config": out.cfg.to_json(),
        "engine": out.engine,
        "run_id": getattr(out, "run_id", ""),
        "extra": extra or {},
    }
    out.flush()          # the run file holds every epoch the checkpoint does
    save_checkpoint(out.run_dir, epoch, state, out.rt, out.cfg.output.keep_checkpoints)


def load_training_state(model: torch.nn.Module, optimizer, state: dict,
                        where, cfg) -> None:
    """Load a checkpoint's model and optimizer state; a checkpoint that does not fit (another
    model shape) is an InputError naming ``where``, the model settings and the first mismatch."""
    load_model_state(model, state["model"], where, cfg)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise InputError(f"{where}: the checkpoint's optimizer state does not fit the model "
                         f"({' '.join(str(exc).split())[:200]})") from None


def restore_training_state(out, model: torch.nn.Module, optimizer) -> tuple[int, dict]:
    """Collective: on ``--resume`` load the newest checkpoint into model and optimizer.

    Returns (first epoch to run, the checkpoint's ``extra``); (1, {}) when not resuming or when
    there is no checkpoint yet. Run-file history after the checkpoint's epoch is dropped.
    """
    if not out.resume:
        return 1, {}
    # rank 0 checked the newest checkpoint (identity, engine, settings, epoch) when the run
    # directory was opened and kept it (RunOutput.resume_state); the other ranks read it here
    state = getattr(out, "resume_state", None)
    out.resume_state = None
    error = None
    if state is None:
        try:
            state = load_latest_checkpoint(out.run_dir, out.meta.content_hash)
        except InputError as exc:
            error = str(exc)
    out.rt.agree(error)
    epochs = out.rt.comm.allgather(None if state is None else int(state["epoch"]))
    if len(set(epochs)) != 1:
        out.rt.agree("ranks see different checkpoints in the run directory "
                     f"(epochs {epochs}); is it on a shared file system?")
    if state is None:
        out.rewind(0)
        return 1, {}
    out.rt.agree_on(lambda: load_training_state(model, optimizer, state, out.run_dir, out.cfg))
    torch.set_rng_state(state["torch_rng"])
    out.rewind(int(state["epoch"]))
    return int(state["epoch"]) + 1, state.get("extra", {})
