#!/usr/bin/env bash
# README command 1: set everything up (idempotent), then train the segmentation demo on
# NP ranks (default 2) with 2 images per rank and synchronized BN. Extra arguments go to
# examples/torch_segmentation.py, e.g. `bash launch/demo.sh --compare` or `--bn local`.
# Runs in the checkout, so checkpoints/ and results/ land there (both git-ignored).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/launch/install.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS=1
exec horovodrun -np "${NP:-2}" "$ROOT/.venv/bin/python" "$ROOT/examples/torch_segmentation.py" "$@"
