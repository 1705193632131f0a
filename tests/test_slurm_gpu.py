"""slurm/train.sh's GPU options, checked on the srun command line it builds (no SLURM and no GPU
needed: a stand-in `srun` first on PATH prints its arguments, one per line)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mpiutil import ROOT

FAKE_SRUN = '#!/bin/bash\nfor a in "$@"; do printf "%s\\n" "$a"; done\n'


@pytest.fixture
def run_script(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)

    def run(**env):
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "HPCGNN_GPU", "HPCGNN_GRES"))}
        base.update(PATH=f"{bin_dir}{os.pathsep}{base.get('PATH', '')}", SLURM_NTASKS="2",
                    SLURM_JOB_ID="7", PARTITIONS="parts", RUN_DIR="run", **env)
        if not (ROOT / ".venv" / "bin" / "python").exists():
            import sys
            base["VENV"] = str(Path(sys.executable).parent.parent)
        proc = subprocess.run(["bash", str(ROOT / "slurm" / "train.sh"), "--force"], capture_output=True,
                              text=True, timeout=60, env=base)
        args = proc.stdout.splitlines()[1:]   # the first line is train.sh's own summary
        return proc, args

    return run


def _train_args(args):
    i = args.index("train")
    return args[i + 1:]


def test_no_gpu_options_by_default(run_script):
    proc, args = run_script()
    assert proc.returncode == 0, proc.stderr
    assert not any(a.startswith(("--gpus-per-task", "--gres", "--gpu-bind")) for a in args)
    assert _train_args(args) == ["--config", "inputs/cora-sage.toml", "--set", "data.partitions=parts",
                                 "--set", "output.dir=run", "--force"]


def test_gpus_per_task_from_sbatch_is_passed_to_srun_and_trains_on_cuda(run_script):
    # sbatch --gpus-per-task=1 exports SLURM_GPUS_PER_TASK=1 into the batch script
    proc, args = run_script(SLURM_GPUS_PER_TASK="1")
    assert proc.returncode == 0, proc.stderr
    assert "--gpus-per-task=1" in args[:args.index("-m")]
    assert _train_args(args)[-3:] == ["--set", "train.device=cuda", "--force"]   # user args last: they win
    assert "2 ranks x auto threads x 1 GPU(s)" in proc.stdout.splitlines()[0]


def test_explicit_gpu_options_and_typed_count(run_script):
    proc, args = run_script(SLURM_GPUS_PER_TASK="1", HPCGNN_GPUS_PER_TASK="a100:2",
                            HPCGNN_GPU_BIND="closest", HPCGNN_GRES="gpu:4")
    assert proc.returncode == 0, proc.stderr
    launch = args[:args.index("-m")]
    assert {"--gpus-per-task=a100:2", "--gpu-bind=closest", "--gres=gpu:4"} <= set(launch)
    # 0 turns the GPU options off even inside a GPU allocation
    proc, args = run_script(SLURM_GPUS_PER_TASK="1", HPCGNN_GPUS_PER_TASK="0")
    assert proc.returncode == 0 and not any(a.startswith("--gpus-per-task") for a in args)
    assert "train.device=cuda" not in args


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "gpu:"])
def test_bad_gpus_per_task_is_one_line_and_exit_2(run_script, value):
    proc, args = run_script(HPCGNN_GPUS_PER_TASK=value)
    assert proc.returncode == 2 and args == [] and proc.stdout == ""
    assert proc.stderr.strip() == (f"train.sh: error: HPCGNN_GPUS_PER_TASK='{value}': expected an "
                                   "integer >= 0 (GPUs per rank)")
