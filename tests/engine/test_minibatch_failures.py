"""Failure handling of `hpcgnn train` under real mpiexec: input errors stop every rank with
exit code 2 and one line; a rank killed mid-epoch ends the job quickly; a run resumed from its
last checkpoint after the kill reaches exactly the parameters of an uninterrupted run."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import debug_env  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = mb.small_config(epochs=3, batch_size=16, fanouts=4, nc=8, checkpoint_every=1, eval_every=1)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fail")
    a = mb.tiny_store(tmp / "a", mb.tiny_graph(seed=0), 2)
    b = mb.tiny_store(tmp / "b", mb.tiny_graph(seed=1), 2)
    return tmp, a, b


def _one_error_line(proc, text):
    lines = [l for l in proc.stderr.splitlines() if l.startswith("hpcgnn: error:")]
    assert len(lines) == 1 and text in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_key_exits_2_on_every_rank(stores):
    tmp, a, _ = stores
    cfg = mb.write_config(tmp / "bad.toml", CONFIG + "bogus_key = 1\n")
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={a}",
                                               "--set", f"output.dir={tmp / 'r_bad'}"])
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    _one_error_line(proc, "unknown key minibatch.bogus_key")


def test_rank_count_mismatch_exits_2_on_every_rank(stores):
    tmp, a, _ = stores
    cfg = mb.write_config(tmp / "ok.toml", CONFIG)
    proc, codes = mb.train_each_rank_exit(3, ["train", "--config", str(cfg), "--set", f"data.partitions={a}",
                                               "--set", f"output.dir={tmp / 'r_mis'}"])
    assert codes == {0: 2, 1: 2, 2: 2}, proc.stdout + proc.stderr
    _one_error_line(proc, "has 2 partitions but the job has 3 ranks")


def test_mixed_partition_store_exits_2_on_every_rank(stores):
    tmp, a, b = stores
    mixed = tmp / "mixed"
    shutil.copytree(a, mixed)
    shutil.copy(b / "part-00001.h5", mixed / "part-00001.h5")   # only rank 1 sees the mismatch
    cfg = mb.write_config(tmp / "ok.toml", CONFIG)
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", str(cfg), "--set", f"data.partitions={mixed}",
                                               "--set", f"output.dir={tmp / 'r_mixed'}"])
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    _one_error_line(proc, "does not match")


def test_killed_rank_ends_job_and_resume_is_exact(stores):
    tmp, a, _ = stores
    cfg = mb.write_config(tmp / "ok.toml", CONFIG)
    full, cut = tmp / "full", tmp / "cut"
    proc = mb.train(2, cfg, a, full)
    assert proc.returncode == 0, proc.stderr
    # rank 1 SIGKILLs itself before step 1 of epoch 2 (after checkpoint 1 was written)
    proc = mb.train(2, cfg, a, cut, timeout=90, env=debug_env(kill=[1, 2, 1]))
    ended = time.time()
    assert proc.returncode != 0
    assert "hpcgnn: error: rank 1 was killed by SIGKILL (out of memory? its peak resident memory was" \
        in proc.stderr, proc.stderr[-2000:]
    ckpts = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert ckpts == ["ckpt-000001.pt"]
    assert ended - (cut / "checkpoints" / "ckpt-000001.pt").stat().st_mtime < 30, "job outlived the kill"
    # rank 1 died by SIGKILL and the launcher killed rank 0: no process could write "failed"
    # (run file docstring, docs/runs.md), so the run file keeps "running"
    assert read_run(cut)["attrs"]["status"] == "running"
    proc = mb.train(2, cfg, a, cut, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert sum(l.startswith("epoch ") for l in proc.stdout.splitlines()) == 2                     # epochs 2 and 3 only
    ref = torch.load(full / "checkpoints" / "ckpt-000003.pt", weights_only=True)
    got = torch.load(cut / "checkpoints" / "ckpt-000003.pt", weights_only=True)
    assert ref["model"].keys() == got["model"].keys()
    for k in ref["model"]:
        assert torch.equal(ref["model"][k], got["model"][k]), k
    r_full, r_cut = read_run(full), read_run(cut)
    assert r_cut["metrics"]["epoch"].tolist() == [1, 2, 3]
    for k in ("loss", "train_acc", "val_acc", "test_acc"):
        assert np.array_equal(r_full["metrics"][k], r_cut["metrics"][k]), k
