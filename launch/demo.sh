#!/usr/bin/env bash
# README command 1: set everything up (idempotent), then train the segmentation demo on
# NP ranks (default 2) with 2 images per rank and synchronized BN. An optional first
# argument picks the framework: `torch` (default, examples/torch_segmentation.py) or
# `keras` (examples/keras_segmentation.py). The other arguments go to the script, e.g.
# `bash launch/demo.sh --compare`, `bash launch/demo.sh keras --bn local`.
# Runs in the checkout, so checkpoints/ and results/ land there (both git-ignored).
# --no-progress (or --progress) overrides the choice below.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
script=torch_segmentation.py
case "${1:-}" in
  torch) shift ;;
  keras) script=keras_segmentation.py; shift ;;
esac
bash "$ROOT/launch/install.sh"
# The ranks cannot tell whether this reaches a terminal (mpirun gives them a pty either
# way): a progress bar that redraws in place if it does, a line per epoch if not.
[ -t 1 ] && set -- --progress "$@"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS=1
exec horovodrun -np "${NP:-2}" "$ROOT/.venv/bin/python" "$ROOT/examples/$script" "$@"
