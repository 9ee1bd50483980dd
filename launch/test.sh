#!/usr/bin/env bash
# README command 2: set everything up (idempotent), then run the whole test suite,
# including the 2- and 3-rank runs under horovodrun (Gloo) and mpirun (MPI).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/launch/install.sh"
cd "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -ra "$@" tests
