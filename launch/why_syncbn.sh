#!/usr/bin/env bash
# The small-batch experiment (docs/why_syncbn.md): set everything up (idempotent), then train local
# BN and SyncBN at 1 and 2 images per rank on NP ranks (default 4) under mpirun, and one
# process at the whole global batch, 3 seeds each (examples/why_syncbn.py). Writes
# results/why_syncbn.md, .json and .png. The arguments go to the script, e.g.
# `bash launch/why_syncbn.sh --seeds 1 --epochs 1`, `NP=8 bash launch/why_syncbn.sh --out results/why_syncbn_8ranks`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/launch/install.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
# --oversubscribe: 4 ranks on a machine with fewer cores (this one has 2).
exec bash "$ROOT/launch/mpirun.sh" -np "${NP:-4}" --oversubscribe -x OMP_NUM_THREADS -- \
  "${HVD_SYNCBN_VENV:-$ROOT/.venv}/bin/python" "$ROOT/examples/why_syncbn.py" "$@"
