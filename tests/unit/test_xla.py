"""The XLA allreduce's set-up in one process: why it is not available (each reason), its
build and cache, and the XLA-context check. The sums themselves run at every world size
in ``tests/ranks_xla.py``."""

from __future__ import annotations

import shutil
import sys

import pytest

from conftest import tensorflow

tf = tensorflow()

from hvd_syncbn.tensorflow import xla, xla_build  # noqa: E402


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty cache folder, and no library loaded yet."""
    monkeypatch.setenv("HVD_SYNCBN_CACHE", str(tmp_path))
    monkeypatch.setattr(xla, "_lib", None)
    return tmp_path


def fake_library() -> None:
    xla_build.library_path().parent.mkdir(parents=True)
    xla_build.library_path().write_bytes(b"")


def test_not_built_names_the_command(cache):
    reason = xla.available()
    assert reason and "not built for TensorFlow" in reason and str(cache) in reason, reason
    assert "python -m hvd_syncbn.tensorflow.xla_build" in reason, reason
    with pytest.raises(RuntimeError, match="hvd_syncbn XLA allreduce: the XLA allreduce is not built"):
        xla.load()


def test_without_mpi4py(monkeypatch, cache):
    fake_library()
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    assert xla.available().startswith("mpi4py is not installed: pip install mpi4py")


def test_with_a_gpu_visible(monkeypatch, cache):
    fake_library()
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: ["/physical_device:GPU:0"] if kind == "GPU" else [])
    assert "no CUDA target is shipped" in xla.available()


def test_tensorflow_without_the_ffi_getter(monkeypatch, cache):
    fake_library()
    monkeypatch.setattr(xla, "_GET_API", "no_such_symbol")
    assert "exports no xla::ffi::GetXlaFfiApi" in xla.available()


def test_refuses_a_launch_that_mpi_does_not_see(monkeypatch, cache):
    """Under horovodrun with Gloo MPI starts as a world of one: summing over it would be local."""
    fake_library()
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(RuntimeError, match="horovodrun --gloo started 2 processes, but MPI sees this one alone"):
        xla.load()


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("mpicc") is None, reason="needs g++ and mpicc")
def test_built_once_per_tensorflow_and_source(cache):
    path = xla_build.build()
    assert path.parent.name.startswith(f"xla-allreduce-tf{xla_build.tensorflow_version()}-"), path
    assert xla.available() is None
    built = path.stat().st_mtime_ns
    assert xla_build.build() == path and path.stat().st_mtime_ns == built  # cached: not rebuilt


def test_in_xla_only_when_compiling():
    seen = []

    def record(x):
        seen.append(xla.in_xla())
        return x

    record(tf.constant(1.0))
    tf.function(record)(tf.constant(1.0))
    tf.function(record, jit_compile=True)(tf.constant(1.0))
    assert seen == [False, False, True]


def test_names_reach_xla_as_mlir_strings():
    assert xla._mlir_string('layer "bn"\\é') == '"layer \\22bn\\22\\5C\\C3\\A9"'
