#!/bin/bash
# Train on a partition store, one MPI rank per partition, under SLURM.
#
#   sbatch slurm/train.sh                      (from the repository root)
#   CONFIG=inputs/cora-sage.toml PARTITIONS=data/cora-metis-4 RUN_DIR=runs/cora4 \
#       sbatch --nodes=2 --ntasks-per-node=2 slurm/train.sh [extra hpcgnn train args, e.g. --force]
#
# Total tasks (nodes x ntasks-per-node) must equal the number of partitions.
# Environment (all optional):
#   CONFIG        TOML run configuration          (default inputs/cora-sage.toml)
#   PARTITIONS    partition directory              (default data/cora-metis-2)
#   RUN_DIR       run output directory             (default runs/slurm-<job id>)
#   HPCGNN_ROOT   repository root; relative paths are relative to it
#                 (default: the submission directory, else this script's parent)
#   VENV          Python environment               (default $HPCGNN_ROOT/.venv)
#   HPCGNN_THREADS  threads per rank               (default SLURM_CPUS_PER_TASK)
#   HPCGNN_PROGRESS progress bars on stderr       (default 0)
#   SRUN_MPI      srun --mpi plugin                (default pmi2: MPICH; pmix for Open MPI builds)
#   HPCGNN_ENTRY  what python runs                 (default "-m hpcgnn train"; e.g.
#                 "-m hpcgnn.demos.hello" checks the launch without training)
#SBATCH --job-name=hpcgnn-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --output=hpcgnn-train-%j.out
set -euo pipefail

# sbatch runs a copy of this script: the repository is the submission directory or HPCGNN_ROOT.
if [[ -z "${HPCGNN_ROOT:-}" && -d "${SLURM_SUBMIT_DIR:-}/hpcgnn" ]]; then HPCGNN_ROOT=$SLURM_SUBMIT_DIR; fi
HPCGNN_ROOT=${HPCGNN_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[[ -f "$HPCGNN_ROOT/slurm/env.sh" ]] || { echo "train.sh: error: $HPCGNN_ROOT is not an hpcgnn checkout (set HPCGNN_ROOT)" >&2; exit 2; }
source "$HPCGNN_ROOT/slurm/env.sh" train.sh

CONFIG=${CONFIG:-inputs/cora-sage.toml}
PARTITIONS=${PARTITIONS:-data/cora-metis-2}
RUN_DIR=${RUN_DIR:-runs/slurm-${SLURM_JOB_ID:-$$}}
read -r -a ENTRY <<< "${HPCGNN_ENTRY:--m hpcgnn train}"

# One rank per task; each rank's torch and OpenMP threads = the task's CPUs (env.sh).
# srun does not inherit --cpus-per-task from sbatch since SLURM 22.05: pass it on.
SRUN_ARGS=(--mpi="${SRUN_MPI:-pmi2}" --kill-on-bad-exit=1)
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi

echo "train.sh: job ${SLURM_JOB_ID:-none} on ${SLURM_JOB_NODELIST:-$(hostname -s)}:" \
     "${SLURM_NTASKS:-?} ranks x ${HPCGNN_THREADS:-auto} threads, config $CONFIG," \
     "partitions $PARTITIONS, run $RUN_DIR"
exec srun "${SRUN_ARGS[@]}" "$PYTHON" "${ENTRY[@]}" --config "$CONFIG" \
    --set "data.partitions=$PARTITIONS" --set "output.dir=$RUN_DIR" "$@"
