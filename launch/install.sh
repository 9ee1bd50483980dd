#!/usr/bin/env bash
# Idempotent set-up from nothing: OpenMPI, .venv/ with torch, TensorFlow and Horovod, and
# the XLA allreduce.
# Used by the README's commands, .ci/run and the Dockerfile. A second run takes seconds:
# the Horovod wheel and the XLA allreduce are built once and cached outside the checkout.
set -euo pipefail

HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TF_VERSION=${TF_VERSION:-2.21.*}
TF_PACKAGE=${TF_PACKAGE:-tensorflow-cpu}   # "tensorflow" for a GPU build
# torch comes from pip's configured indexes (on Linux PyPI's is the CUDA build, about 15
# nvidia-* wheels, unless pip finds a CPU wheel first, as on CI's machine) or, when set,
# from TORCH_INDEX_URL: https://download.pytorch.org/whl/cpu for the CPU build, .../cu130 for CUDA 13.0.
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_SYNCBN_VENV:-$ROOT/.venv}
CACHE=${HVD_SYNCBN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_syncbn}
PYTHON=${PYTHON:-python3}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}

log() { echo "[install] $*" >&2; }
die() { echo "[install] ERROR: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. System packages: OpenMPI (mpirun and headers), a C++ toolchain and cmake < 4.
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi ] || command -v mpicc >/dev/null || missing+=(libopenmpi-dev)
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v make >/dev/null || missing+=(make)
if command -v "$PYTHON" >/dev/null; then
  "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
  [ -n "$("$PYTHON" -c 'import sysconfig; import os; print(os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") or "")')" ] \
    || missing+=(python3-dev)
else
  missing+=(python3 python3-venv python3-dev)   # a bare Debian, as the image's base
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v "$PYTHON" >/dev/null || die "no $PYTHON: set PYTHON to a Python 3.11+ interpreter"

# 2. The virtual environment and the Python packages (skipped when already pinned).
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"
reqs=("torch==$TORCH_VERSION" "$TF_PACKAGE==$TF_VERSION" numpy mpi4py pytest hypothesis matplotlib tqdm
      cloudpickle psutil pyyaml packaging cffi)
stamp="$VENV/.hvd_syncbn-reqs"
if [ "$(cat "$stamp" 2>/dev/null)" != "${reqs[*]}" ]; then
  log "pip install ${reqs[*]}"
  "$PY" -m pip install -q --upgrade pip wheel setuptools
  [ -z "$TORCH_INDEX_URL" ] || "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  "$PY" -m pip install -q "${reqs[@]}"
  echo "${reqs[*]}" > "$stamp"
fi
log "$("$PY" -c 'import torch; print("torch", torch.__version__ + ", CUDA", torch.version.cuda or "none (a CPU build)")')"

# 3. Horovod, built once per (Horovod, torch, TF, Python) and cached as a wheel.
# (Read from the package metadata: importing TensorFlow would print its start-up lines.)
versions=$("$PY" - "$TF_PACKAGE" <<'PY'
import sys, importlib.metadata as m
print(f"torch{m.version('torch')}-tf{m.version(sys.argv[1])}-py{sys.version_info[0]}{sys.version_info[1]}")
PY
)
gpu=${HOROVOD_GPU_OPERATIONS:+-gpu$HOROVOD_GPU_OPERATIONS}
versions="$versions$gpu"
wheel_dir="$CACHE/horovod-$HOROVOD_VERSION-fixes6-$versions"   # bump fixesN when the fixes below change
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  log "building Horovod $HOROVOD_VERSION ($versions); this takes about 10 minutes once"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
  tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
  src="$build/horovod-$HOROVOD_VERSION"
  # The four fixes Horovod 0.28.1 needs against torch 2.13 / TF 2.21 / cmake 4, a fifth:
  # horovodrun's extension check mutes its child's sys.stdout/stderr, but TensorFlow's
  # C++ start-up lines go to the file descriptors and reached the console; and a sixth:
  # that check (is MPI or Gloo built?) imports the first framework's extension in a
  # child, so PyTorch's goes first (2.4 s to import here, TensorFlow's 6 s, per launch).
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || die "C++17 patch did not apply"
  ! grep -q 'xla_mpi_ops' "$src/horovod/tensorflow/CMakeLists.txt" || die "XLA patch did not apply"
  sed -i "s/^\( *\)sys.stderr = open(os.devnull, 'w')$/&\n\1os.dup2(sys.stdout.fileno(), 1); os.dup2(sys.stderr.fileno(), 2)/" \
    "$src/horovod/common/util.py"
  grep -q 'os.dup2(sys.stdout.fileno(), 1)' "$src/horovod/common/util.py" || die "extension-check patch did not apply"
  sed -i "s/^EXTENSIONS = \['tensorflow', 'torch', 'mxnet'\]$/EXTENSIONS = ['torch', 'tensorflow', 'mxnet']/" \
    "$src/horovod/common/util.py"
  grep -q "^EXTENSIONS = \['torch'," "$src/horovod/common/util.py" || die "extension-order patch did not apply"
  tf_inc=$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)
  export CPLUS_INCLUDE_PATH="$tf_inc/external/highwayhash${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
         HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1
  MAKEFLAGS="-j$(nproc)"
  export MAKEFLAGS
  (cd "$src" && "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$build/dist" .) \
    || die "Horovod build failed (see the compiler output above)"
  mkdir -p "$wheel_dir"
  cp "$build"/dist/horovod-*.whl "$wheel_dir/"
fi
# Installed unless this very wheel is (a new set of fixes replaces an older build).
hvd_stamp="$VENV/.hvd_syncbn-horovod"
if [ "$(cat "$hvd_stamp" 2>/dev/null)" != "$wheel_dir" ] || ! "$PY" -c 'import horovod' 2>/dev/null; then
  log "pip install $(basename "$wheel_dir"/horovod-*.whl)"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  echo "$wheel_dir" > "$hvd_stamp"
fi

# 4. The project itself, editable.
here=$(cd /tmp && "$PY" -c 'import hvd_syncbn, os; print(os.path.dirname(os.path.dirname(hvd_syncbn.__file__)))' 2>/dev/null || true)
if [ "$here" != "$ROOT" ]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>&1 \
    || "$PY" -m pip install --no-deps --no-build-isolation -e "$ROOT"
fi

# 5. The XLA allreduce of the Keras layer (a small C++ library, cached like the Horovod
#    wheel, per TensorFlow version and source). Without it the layer does not run inside XLA.
#    (Its output only on failure: importing TensorFlow prints start-up lines.)
if ! out=$(cd /tmp && HVD_SYNCBN_CACHE="$CACHE" "$PY" -m hvd_syncbn.tensorflow.xla_build 2>&1); then
  echo "$out" >&2
  log "the XLA allreduce did not build (above): the Keras layer will not support jit_compile=True"
fi

# 6. With HVD_SYNCBN_DROP_BUILD_DEPS=1 (the image), remove the build-only packages this
#    run installed (compilers, headers, cmake).
if [ "${HVD_SYNCBN_DROP_BUILD_DEPS:-0}" = 1 ]; then
  build_only=()
  for pkg in "${missing[@]}"; do
    case $pkg in g++|cmake|make|libopenmpi-dev|python3-dev) build_only+=("$pkg") ;; esac
  done
  if [ ${#build_only[@]} -gt 0 ]; then
    log "apt-get purge --auto-remove ${build_only[*]}"
    DEBIAN_FRONTEND=noninteractive as_root apt-get purge -y -qq --auto-remove "${build_only[@]}" >/dev/null
  fi
fi

# 7. A check that Horovod has everything we use: its TensorFlow and PyTorch extensions, each
#    built with MPI and Gloo. (`horovodrun --check-build` says the same, importing each
#    framework anew for each feature: 35 s here against 7 s for one import of each.)
check='
import sys
missing = []
for name, module in [("TensorFlow", "horovod.tensorflow"), ("PyTorch", "horovod.torch")]:
    try:
        hvd = __import__(module, fromlist=["mpi_built"])
    except ImportError as e:
        missing.append(f"{name} ({e})")
        continue
    missing += [f"{op} for {name}" for op in ("MPI", "Gloo") if not getattr(hvd, op.lower() + "_built")()]
sys.exit("Horovod lacks " + ", ".join(missing) if missing else 0)'
if ! out=$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "$check" 2>&1); then
  echo "$out" >&2
  die "expected Horovod $HOROVOD_VERSION with TensorFlow, PyTorch, MPI and Gloo (above: what it lacks)"
fi
log "ready: $VENV (Horovod $HOROVOD_VERSION with TensorFlow, PyTorch, MPI, Gloo)"
