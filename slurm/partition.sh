#!/bin/bash
# Import a graph (if its file is missing) and partition it: a single-task job.
#
#   sbatch slurm/partition.sh [GRAPH [PARTS [OUT]]]          (from the repository root)
#   GRAPH=data/cora.h5 PARTS=4 sbatch slurm/partition.sh
#
# Arguments or environment (arguments win):
#   GRAPH      graph file                       (default data/cora.h5)
#   PARTS      number of partitions = ranks     (default 2)
#   OUT        partition directory              (default <GRAPH without .h5>-<METHOD>-<PARTS>,
#                                                 the name `make partition` uses)
# Environment only:
#   METHOD     metis | random | contiguous       (default metis)
#   SEED       partitioning seed                 (default 0)
#   DATASET    dataset `hpcgnn prepare` imports when GRAPH is missing
#              (default: GRAPH's base name, e.g. cora)
#   DATA_ROOT  raw dataset directory for prepare (default inputs/data)
#   PREPARE_ARGS  more `hpcgnn prepare` arguments, e.g. "--nodes 20000 --edges 200000"
#                 with DATASET=sbm
#   HPCGNN_ROOT, VENV  as in train.sh
# METIS is single-threaded; the CPUs speed up `prepare` and the partition writer.
#SBATCH --job-name=hpcgnn-partition
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --output=hpcgnn-partition-%j.out
set -euo pipefail

# sbatch runs a copy of this script: the repository is the submission directory or HPCGNN_ROOT.
if [[ -z "${HPCGNN_ROOT:-}" && -d "${SLURM_SUBMIT_DIR:-}/hpcgnn" ]]; then HPCGNN_ROOT=$SLURM_SUBMIT_DIR; fi
HPCGNN_ROOT=${HPCGNN_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[[ -f "$HPCGNN_ROOT/slurm/env.sh" ]] || { echo "partition.sh: error: $HPCGNN_ROOT is not an hpcgnn checkout (set HPCGNN_ROOT)" >&2; exit 2; }
source "$HPCGNN_ROOT/slurm/env.sh" partition.sh

GRAPH=${1:-${GRAPH:-data/cora.h5}}
PARTS=${2:-${PARTS:-2}}
METHOD=${METHOD:-metis}
SEED=${SEED:-0}
OUT=${3:-${OUT:-${GRAPH%.h5}-$METHOD-$PARTS}}
DATASET=${DATASET:-$(basename "${GRAPH%.h5}")}
DATA_ROOT=${DATA_ROOT:-inputs/data}


if [[ ! -f "$GRAPH" ]]; then
    echo "partition.sh: $GRAPH is missing: importing dataset '$DATASET' from $DATA_ROOT"
    mkdir -p "$(dirname "$GRAPH")"
    read -r -a MORE <<< "${PREPARE_ARGS:-}"
    "$PYTHON" -m hpcgnn prepare --dataset "$DATASET" --root "$DATA_ROOT" --out "$GRAPH" "${MORE[@]}"
fi
echo "partition.sh: $GRAPH -> $OUT ($PARTS parts, $METHOD, seed $SEED)"
"$PYTHON" -m hpcgnn partition "$GRAPH" --parts "$PARTS" --method "$METHOD" --seed "$SEED" \
    --out "$OUT" --force
"$PYTHON" -m hpcgnn inspect "$OUT"
