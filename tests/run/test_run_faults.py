"""Faults around the run directory under real mpiexec (issue 23, classes 1, 3, 4 and 8): a full
disk, an unwritable directory, two jobs on one run directory, a killed rank, a misused command
line. Each gives one line naming the path (or rank) and the reason, exit 2 on every rank (a kill:
the killed rank's line first), and leaves what was good before as it was.

A full disk is a small tmpfs (root with CAP_SYS_ADMIN, as on the project's machines and CI;
skipped otherwise, saying so); an unwritable directory is mode 0555 seen by a root whose
CAP_DAC_OVERRIDE is dropped (``setpriv``), so the test needs no second user.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import mb_support as mb  # noqa: E402
from mpiutil import MPIEXEC, ROOT, clean_env, debug_env, run_mpi  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

SAGE = ROOT / "inputs" / "cora-sage.toml"
GCN = ROOT / "inputs" / "cora-gcn-fullgraph.toml"
QUICK = ["--set", "train.eval_every=0", "--set", "minibatch.eval=sampled"]
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search", "--"]


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("hpcgnn: error:")]


def _one_line(proc, *words):
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def _train_args(config, parts, run, *extra):
    return ["train", "--config", str(config), "--set", f"data.partitions={parts}",
            "--set", f"output.dir={run}", *extra]


@pytest.fixture
def tmpfs(small_tmpfs):
    """A 2 MiB tmpfs (tests/conftest.py small_tmpfs)."""
    return small_tmpfs("2m")


@pytest.fixture
def no_dac():
    """The command prefix that drops root's permission override; skip where setpriv is missing or
    the drop does not take (not root)."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop CAP_DAC_OVERRIDE (the unwritable-directory cases)")
    return NO_DAC


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` completely; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


# ---- class 1: I/O failures ----------------------------------------------------------------------
def test_disk_full_at_a_checkpoint_is_one_line_and_the_run_file_says_failed(cora_parts, tmpfs):
    run = tmpfs / "run"
    proc, codes = mb.train_each_rank_exit(2, _train_args(SAGE, cora_parts(2), run, *QUICK,
                                                         "--set", "train.epochs=3",
                                                         "--set", "train.checkpoint_every=1"),
                                          timeout=180)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    line = _one_line(proc, "No space left on device (ENOSPC)", str(run / "checkpoints"))
    r = read_run(run)
    assert r["attrs"]["status"] == "failed" and r["attrs"]["error"] == line[len("hpcgnn: error: "):]
    assert r["metrics"]["epoch"].tolist() == [1]
    assert not [p for p in (run / "checkpoints").iterdir()], "a partial checkpoint was left"


def test_disk_full_at_start_leaves_no_run_behind(cora_parts, tmpfs):
    run = tmpfs / "run"
    filler = _fill(tmpfs)
    args = _train_args(SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=1",
                       "--set", "model.hidden=8")   # a checkpoint that fits the 2 MiB
    proc, codes = mb.train_each_rank_exit(2, args, timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    _one_line(proc, "No space left on device (ENOSPC)", str(run))
    assert not (run / "run.h5").exists()
    filler.unlink()
    # the failed start left no run: a plain train (no --force) into the directory is accepted
    proc, codes = mb.train_each_rank_exit(2, args, timeout=120)
    assert codes == {0: 0, 1: 0}, proc.stdout + proc.stderr
    assert read_run(run)["attrs"]["status"] == "finished"


def test_unwritable_checkpoints_and_run_dir_are_refused_before_training(cora_parts, tmp_path, no_dac):
    base = tmp_path / "w"
    base.mkdir(mode=0o777)
    base.chmod(0o777)
    run = base / "run"
    args = _train_args(SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=1")
    proc, codes = mb.train_each_rank_exit(2, args, timeout=120)
    assert codes == {0: 0, 1: 0}, proc.stderr
    before = (run / "run.h5").read_bytes()
    for target, what in ((run / "checkpoints", "checkpoint directory"), (run, "run directory")):
        target.chmod(0o555)
        try:
            cmd = [*no_dac, str(MPIEXEC), "-n", "2", sys.executable, "-c", mb.RANK_EXIT,
                   *_train_args(SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=3"), "--resume"]
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
        finally:
            target.chmod(0o755)
        assert "RANK 0 EXIT 2" in got.stdout and "RANK 1 EXIT 2" in got.stdout, got.stdout + got.stderr
        _one_line(got, str(target), f"{what} is not writable", "(EACCES)")
        assert (run / "run.h5").read_bytes() == before     # nothing trained, nothing rewritten


def test_infer_refuses_an_unwritable_out_before_inferring(cora_parts, tmp_path, no_dac):
    run = tmp_path / "run"
    proc = mb.train(2, SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=1")
    assert proc.returncode == 0, proc.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cmd = [*no_dac, str(MPIEXEC), "-n", "2", sys.executable, "-m", "hpcgnn", "infer", str(run),
           "--out", str(ro / "x.h5")]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert got.returncode == 2, got.stderr
    _one_line(got, str(ro), "--out directory is not writable", "(EACCES)")
    assert "wrote" not in got.stdout + got.stderr


# ---- class 3: two jobs on one run directory -----------------------------------------------------
def test_a_live_run_directory_is_locked_against_force_and_resume(cora_parts, tmp_path):
    run = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "hpcgnn",
           *_train_args(SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=2000",
                        "--set", "train.checkpoint_every=1")]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=clean_env(), cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not list((run / "checkpoints").glob("ckpt-*.pt")):
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.2)
        for flag in ("--force", "--resume"):
            proc, codes = mb.train_each_rank_exit(2, _train_args(SAGE, cora_parts(2), run, *QUICK,
                                                                 "--set", "train.epochs=2000",
                                                                 "--set", "train.checkpoint_every=1",
                                                                 flag), timeout=120)
            assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
            _one_line(proc, f"{run}: run directory is in use by another job", "pid ", "hpcgnn train")
        assert first.poll() is None, "the refused jobs disturbed the first one"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert read_run(run)["attrs"]["status"] == "running"      # killed from outside: nobody wrote
    # the lock died with the job: a resume goes on from its last checkpoint
    from hpcgnn.run.checkpoint import list_checkpoints

    last = list_checkpoints(run)[-1][0]
    proc = mb.train(2, SAGE, cora_parts(2), run, *QUICK, "--set", f"train.epochs={last + 1}",
                    "--set", "train.checkpoint_every=1", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert read_run(run)["metrics"]["epoch"].tolist()[-1] == last + 1
    assert not (run / ".hpcgnn.lock").exists()


# ---- class 8: kill messages, command-line errors ------------------------------------------------
def test_a_killed_rank_is_named_first_and_the_survivors_give_no_traceback(cora_parts, tmp_path):
    """(Whether a survivor notices the death before the launcher ends it is a race; the survivor's
    own line is tested deterministically in tests/runtime/test_failures.py.)"""
    run = tmp_path / "run"
    proc = mb.train(2, GCN, cora_parts(2), run, "--set", "train.epochs=5", "--set", "train.eval_every=0",
                    timeout=120, env=debug_env(kill=[1, 3, 0]))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn:")]
    assert lines and lines[0].startswith("hpcgnn: error: rank 1 was killed by SIGKILL"), proc.stderr
    assert "Traceback" not in proc.stderr and "failed: " not in proc.stderr, proc.stderr
    error = read_run(run)["attrs"].get("error", "")
    assert "rank 0:" not in error, error      # rank 0 survived: it is not blamed


def test_command_line_errors_print_once_under_mpiexec():
    for args in (["-m", "hpcgnn", "--bogus"], ["-m", "hpcgnn", "bogus-command"],
                 ["-m", "hpcgnn", "train", "--no-such-flag"]):
        proc = run_mpi(3, args, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert len(_error_lines(proc.stderr)) == 1, proc.stderr


def test_disk_full_when_the_run_file_is_rewritten_keeps_the_last_good_one(tmpfs):
    """In one process (COMM_SELF): the epoch's rewrite of run.h5 fails on a full disk with one
    line naming the file and ENOSPC; the previous run.h5 stays readable."""
    from types import SimpleNamespace

    from mpi4py import MPI

    from hpcgnn.errors import InputError
    from hpcgnn.run.config import load_config
    from hpcgnn.run.output import RunOutput
    from hpcgnn.runtime import Runtime

    rt = Runtime.start(threads=1, comm=MPI.COMM_SELF)
    run = tmpfs / "run"
    cfg = load_config(None, ["data.partitions=x", f"output.dir={run}", "output.flush_seconds=0"])
    meta = SimpleNamespace(content_hash="ab" * 32, path=tmpfs / "parts", num_parts=1)
    out = RunOutput(run, rt, cfg, meta, resume=False, force=False)
    out.log_epoch(1, {"loss": 1.0}, {"epoch": 1.0}, {})
    filler = _fill(tmpfs)
    with pytest.raises(InputError) as exc:
        out.log_epoch(2, {"loss": 0.5}, {"epoch": 1.0}, {"bytes": 1.0})
    assert str(exc.value).startswith(f"{run / 'run.h5'}: cannot write (No space left on device (ENOSPC))")
    assert read_run(run)["metrics"]["epoch"].tolist() == [1]
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
    filler.unlink()
    out.close()
    assert read_run(run)["attrs"]["status"] == "finished"


def _leave_free(filler: Path, nbytes: int) -> None:
    """Free ``nbytes`` of a full file system by shortening its filler file."""
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - nbytes))


MIDWAY = r"""
import os, sys
from types import SimpleNamespace
import numpy as np
from mpi4py import MPI
from hpcgnn.errors import InputError
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.run.runfile import read_run
from hpcgnn.runtime import Runtime

mnt, free_kib = sys.argv[1], int(sys.argv[2])
rt = Runtime.start(threads=1, comm=MPI.COMM_SELF)
run = os.path.join(mnt, "run")
cfg = load_config(None, ["data.partitions=x", f"output.dir={run}", "output.flush_seconds=0"])
out = RunOutput(run, rt, cfg, SimpleNamespace(content_hash="ab" * 32, path=mnt, num_parts=1),
                resume=False, force=False)
out.log_epoch(1, {"loss": 1.0}, {"epoch": 1.0}, {})
filler = os.path.join(mnt, "filler")
with open(filler, "wb") as f:
    try:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    except OSError:
        pass
os.truncate(filler, os.path.getsize(filler) - (free_kib << 10))
try:   # 300 per-layer datasets of 800 B: HDF5 fails flushing its metadata
    out.log_epoch(2, {"loss": 0.5}, {"epoch": 1.0}, {}, {f"x{i}": np.ones(100) for i in range(300)})
except InputError as exc:
    print("ERROR", exc)
print("EPOCHS", read_run(run)["metrics"]["epoch"].tolist())
print("LEFT", sorted(os.listdir(run)))
"""


def test_disk_full_midway_through_the_run_file_names_it_with_the_os_reason(tmpfs):
    """Some space left, less than the new run.h5 needs, so HDF5 fails inside its own writes (its
    text was "Disable slist on flush dest failure failed", and the process then crashed at exit
    with status 139): one line naming run.h5 and ENOSPC, the previous run.h5 kept, no temporary
    left, and the process ends normally."""
    free_kib = 256                  # more than write_failure's probe of the directory writes
    proc = subprocess.run([sys.executable, "-c", MIDWAY, str(tmpfs), str(free_kib)], capture_output=True,
                          text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"ERROR {tmpfs / 'run' / 'run.h5'}: cannot write (No space left on device (ENOSPC))\n" in proc.stdout
    assert "EPOCHS [1]\n" in proc.stdout and "LEFT ['.hpcgnn.lock', 'checkpoints', 'run.h5']" in proc.stdout, proc.stdout


def test_disk_full_during_infer_out_names_the_file_and_every_rank_exits_2(cora_parts, tmp_path, tmpfs):
    run = tmp_path / "run"
    proc = mb.train(2, SAGE, cora_parts(2), run, *QUICK, "--set", "train.epochs=1")
    assert proc.returncode == 0, proc.stderr
    target = tmpfs / "logits.h5"
    filler = _fill(tmpfs)
    _leave_free(filler, 16 << 10)           # the file is made; its 100 kB of rows do not fit
    proc, codes = mb.train_each_rank_exit(2, ["infer", str(run), "--out", str(target)], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    _one_line(proc, f"{target}: cannot write (No space left on device (ENOSPC))")
    assert "Abort" not in proc.stderr and "wrote" not in proc.stdout, proc.stderr
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]     # no output, no temporary


def test_mpich_gforker_is_refused_and_the_launchers_are_named(tmp_path):
    """MPICH's mpiexec.gforker ends with exit status 0 when a rank is killed by a signal: train
    and infer refuse it (one line, exit 2 from every rank, so the launcher's status is 2)."""
    gforker = MPIEXEC.parent / "mpiexec.gforker"
    if not gforker.exists():
        pytest.skip(f"{gforker} is not installed (the MPICH wheel ships it)")
    for args in (["train", "--config", str(SAGE)], ["infer", str(tmp_path), "--out", str(tmp_path / "x.h5")]):
        proc = subprocess.run([str(gforker), "-n", "2", sys.executable, "-m", "hpcgnn", *args],
                              capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        _one_line(proc, "started by mpiexec.gforker", "exit status is 0 even when a rank is killed",
                  "MPICH's mpiexec (Hydra", "srun --mpi=pmi2", "Open MPI's mpiexec")
