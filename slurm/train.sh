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
#   HPCGNN_GPUS_PER_TASK  GPUs per rank: srun --gpus-per-task=N and --set train.device=cuda
#                 (default SLURM_GPUS_PER_TASK, i.e. what `sbatch --gpus-per-task=N` asked for;
#                 0 or unset: no GPU options). The allocation must hold the GPUs: submit with
#                 --gpus-per-task=N (or --gres=gpu:K with K >= N x tasks per node).
#   HPCGNN_GPU_BIND srun --gpu-bind value, e.g. closest (default: SLURM's, per_task:N)
#   HPCGNN_GRES   srun --gres value for the step, e.g. gpu:4 (GPUs per node, not bound to tasks:
#                 every rank sees them all and takes node-local rank mod 4)
#   HPCGNN_ENTRY  what python runs                 (default "-m hpcgnn train"; e.g.
#                 "-m hpcgnn.demos.hello" checks the launch without training)
#   HPCGNN_REQUEUE  1: when the run stopped on a signal with its checkpoint (exit 75), requeue
#                 this job (scontrol requeue); the restarted job continues the run (default 0)
#
# Time limits and preemption (docs/runs.md, "Stopping"): SLURM sends SIGUSR1 to every rank
# --signal's LEAD seconds before the time limit (below: 300 s; give LEAD at least one epoch and
# a checkpoint write, which `hpcgnn report` shows). The ranks end the epoch in progress, write
# its checkpoint and exit 75; the time limit's own SIGTERM, scancel and a preemption do the same
# while KillWait lasts (SLURM's default: 30 s). A restarted job (SLURM_RESTART_COUNT > 0:
# HPCGNN_REQUEUE, `scontrol requeue`, PreemptMode=REQUEUE) runs `hpcgnn train --resume` (a
# --force among the script arguments is dropped then: it would start the run over).
#SBATCH --job-name=hpcgnn-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --signal=USR1@300
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

# GPUs: one rank per GPU. SLURM_GPUS_PER_TASK may carry a type ("a100:1"): the count is last.
GPUS_PER_TASK=${HPCGNN_GPUS_PER_TASK:-${SLURM_GPUS_PER_TASK:-0}}
if [[ ! "${GPUS_PER_TASK##*:}" =~ ^[0-9]+$ ]]; then
    echo "train.sh: error: HPCGNN_GPUS_PER_TASK='$GPUS_PER_TASK': expected an integer >= 0 (GPUs per rank)" >&2
    exit 2
fi
DEVICE_ARGS=()
GPU_NOTE=""
if (( 10#${GPUS_PER_TASK##*:} > 0 )); then
    SRUN_ARGS+=(--gpus-per-task="$GPUS_PER_TASK")
    DEVICE_ARGS=(--set train.device=cuda)
    GPU_NOTE=" x $GPUS_PER_TASK GPU(s)"
fi
if [[ -n "${HPCGNN_GRES:-}" ]]; then
    SRUN_ARGS+=(--gres="$HPCGNN_GRES")
    DEVICE_ARGS=(--set train.device=cuda)
    GPU_NOTE="$GPU_NOTE, gres $HPCGNN_GRES"
fi
if [[ -n "${HPCGNN_GPU_BIND:-}" ]]; then
    SRUN_ARGS+=(--gpu-bind="$HPCGNN_GPU_BIND")
fi

REQUEUE=${HPCGNN_REQUEUE:-0}
if [[ "$REQUEUE" != 0 && "$REQUEUE" != 1 ]]; then
    echo "train.sh: error: HPCGNN_REQUEUE='$REQUEUE': expected 0 or 1" >&2
    exit 2
fi
RESTARTS=${SLURM_RESTART_COUNT:-0}
ARGS=("$@")
if [[ "$RESTARTS" =~ ^[0-9]+$ ]] && (( RESTARTS > 0 )); then
    ARGS=()
    for a in "$@"; do [[ "$a" == --force || "$a" == --resume ]] || ARGS+=("$a"); done
    ARGS+=(--resume)
    echo "train.sh: restart $RESTARTS of job $SLURM_JOB_ID: continuing the run in $RUN_DIR (--resume)"
fi

echo "train.sh: job ${SLURM_JOB_ID:-none} on ${SLURM_JOB_NODELIST:-$(hostname -s)}:" \
     "${SLURM_NTASKS:-?} ranks x ${HPCGNN_THREADS:-auto} threads$GPU_NOTE, config $CONFIG," \
     "partitions $PARTITIONS, run $RUN_DIR"
# srun runs in the background of this shell, which waits for it: a signal for the shell alone
# (sbatch --signal=B:USR1@LEAD, scancel --batch) is passed on to srun, which passes it to every
# rank, and SLURM's SIGTERM does not end the shell (and with it the job) while the ranks write
# their checkpoint. The ranks get the signals SLURM sends to the step from SLURM itself.
SRUN_PID=
for sig in USR1 USR2 TERM; do     # set before srun starts: no signal finds the shell unprepared
    trap "[[ -n \$SRUN_PID ]] && kill -$sig \$SRUN_PID 2>/dev/null || true" "$sig"
done
srun "${SRUN_ARGS[@]}" "$PYTHON" "${ENTRY[@]}" --config "$CONFIG" \
    --set "data.partitions=$PARTITIONS" --set "output.dir=$RUN_DIR" ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"} \
    ${ARGS[@]+"${ARGS[@]}"} &
SRUN_PID=$!
while :; do
    rc=0
    wait "$SRUN_PID" || rc=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break     # a trapped signal interrupted the wait: wait on
done
trap - USR1 USR2 TERM
if (( rc == 75 && REQUEUE == 1 )); then
    echo "train.sh: the run stopped after its checkpoint (exit 75): requeueing job $SLURM_JOB_ID to continue it"
    # ends this job; SLURM starts it again (SLURM_RESTART_COUNT + 1)
    scontrol requeue "$SLURM_JOB_ID" || echo "train.sh: error: could not requeue job $SLURM_JOB_ID" \
        "(submitted with --no-requeue, or JobRequeue=0?): resubmit it, the run continues with --resume" >&2
fi
exit "$rc"
