# Shared set-up of the hpcgnn batch scripts; sourced, not submitted:
#
#   source "$HPCGNN_ROOT/slurm/env.sh" SCRIPT_NAME
#
# Needs HPCGNN_ROOT (the repository root). Enters it, checks the venv's Python and sets
#   PYTHON                          $VENV/bin/python (VENV default $HPCGNN_ROOT/.venv)
#   OMP_NUM_THREADS, HPCGNN_THREADS the task's CPUs when SLURM_CPUS_PER_TASK is set
#                                   (HPCGNN_THREADS only if unset)
#   HPCGNN_PROGRESS                 0 unless set (no progress bars in batch logs)
cd "$HPCGNN_ROOT"
VENV=${VENV:-$HPCGNN_ROOT/.venv}
PYTHON=$VENV/bin/python
if [[ ! -x "$PYTHON" ]]; then
    echo "${1:-hpcgnn}: error: no Python at $PYTHON (run 'make install' or set HPCGNN_ROOT / VENV)" >&2
    exit 2
fi
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
    export HPCGNN_THREADS=${HPCGNN_THREADS:-$SLURM_CPUS_PER_TASK}
fi
export HPCGNN_PROGRESS=${HPCGNN_PROGRESS:-0}
