"""Builds the XLA allreduce (``xla_allreduce.cc``) once per TensorFlow and source version.

The library is cached outside the package, where ``launch/install.sh`` keeps the Horovod
wheel: ``$HVD_SYNCBN_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hvd_syncbn``, in a folder
named by the TensorFlow version and the source's hash, so a new TensorFlow or a changed
source builds anew. Build it with ``python -m hvd_syncbn.tensorflow.xla_build`` (about 10 s).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

SOURCE = Path(__file__).with_name("xla_allreduce.cc")
LIBRARY = "libhvd_syncbn_xla.so"
BUILD_COMMAND = "python -m hvd_syncbn.tensorflow.xla_build"


def cache_dir() -> Path:
    """``$HVD_SYNCBN_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hvd_syncbn`` (as install.sh)."""
    if os.environ.get("HVD_SYNCBN_CACHE"):
        return Path(os.environ["HVD_SYNCBN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvd_syncbn"


def tensorflow_version() -> str:
    """The installed TensorFlow's version, from its package metadata (no import)."""
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-intel"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def library_path() -> Path:
    """Where the library for this TensorFlow and this source lives (built or not)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"xla-allreduce-tf{tensorflow_version()}-{digest}" / LIBRARY


def mpi_flags() -> Tuple[List[str], List[str]]:
    """Compile and link flags of the MPI that mpi4py was built with (its ``mpicc``)."""
    mpicc = "mpicc"
    try:
        import mpi4py

        mpicc = mpi4py.get_config().get("mpicc", mpicc)
    except ImportError:
        pass

    def show(*args: str) -> List[str]:
        return shlex.split(subprocess.run([mpicc, *args], check=True, capture_output=True, text=True).stdout)

    try:  # Open MPI
        return show("--showme:compile"), show("--showme:link")
    except (OSError, subprocess.CalledProcessError):  # MPICH: the whole command line
        flags = show("-show")[1:]
        return ([f for f in flags if f.startswith(("-I", "-D"))],
                [f for f in flags if f.startswith(("-L", "-l", "-Wl", "-pthread"))])


def build(force: bool = False) -> Path:
    """Compile the library into :func:`library_path` unless it is there; return its path.

    Needs a C++17 compiler (``$CXX``, else ``g++``), TensorFlow's headers and an MPI's
    (``mpicc``). It links TensorFlow's framework library (for its op kernel) and receives
    the XLA FFI API table at load time (:func:`hvd_syncbn.tensorflow.xla.load`).
    Raises ``RuntimeError`` with the compiler's output when the build fails.
    """
    target = library_path()
    if target.exists() and not force:
        return target
    import tensorflow as tf

    # TensorFlow's compile flags (its include folder, C++17, its libstdc++ ABI) and link flags.
    mpi_compile, mpi_link = mpi_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then renamed: never half a library
        out = Path(tmp) / LIBRARY
        cmd = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", *tf.sysconfig.get_compile_flags(),
               *mpi_compile, str(SOURCE), "-o", str(out), *mpi_link, *tf.sysconfig.get_link_flags()]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the XLA allreduce failed:\n{shlex.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(out, target)
    return target


def main() -> int:
    force = "--force" in sys.argv[1:]
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        print("hvd_syncbn: no C++ compiler (g++ or $CXX): the XLA allreduce is not built", file=sys.stderr)
        return 1
    try:
        print(build(force=force))
    except Exception as e:  # noqa: BLE001 - reported, then the exit status says it
        print(f"hvd_syncbn: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
