"""Helpers shared by the test files: the markers of the test tiers, an in-process world
of ranks as threads, and a temporary folder per process.

pytest loads this file under horovodrun and mpirun too (the ``ranks_*.py`` suites), so it
imports only the standard library, numpy, pytest and the framework-free
:mod:`hvd_syncbn.comm`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import pytest

from hvd_syncbn import comm, settings


MARKERS = {
    "ranks": "starts ranks under horovodrun or mpirun on this machine (the rank-side suites, launched scripts)",
    "failures": "ranks that disagree, send bad input or die, launched; every rank must stop in time",
    "multihost": "ranks on 2 emulated hosts (network namespaces; needs root and iproute2)",
    "image": "builds the container image (launch/image.sh, as root) and runs in it",
    "slow": "takes a minute or more on a 2-core machine",
    "fake_cuda": "the PyTorch GPU path on fake CUDA tensors, no GPU (fake_cuda_tier.py, in a process of its own)",
}


def pytest_configure(config):
    """Registers the tiers' markers: ``pytest -m "not image and not multihost"`` and the like."""
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(session, config, items):
    """The in-process tier (``tests/unit``) runs first, in its own order: while the image
    builds in the background, before the ``failures`` tests wait for the build to end."""
    unit = Path(__file__).parent / "unit"
    items.sort(key=lambda item: unit not in item.path.parents)


def pytest_collection_finish(session):
    """Starts the image build in the background when its tests are selected: the tests
    before them run meanwhile (``test_image.py`` says why)."""
    if not session.config.option.collectonly and any(item.get_closest_marker("image") for item in session.items):
        import test_image

        test_image.start_build()


def pytest_runtest_setup(item):
    """Tests that time how fast ranks stop (``failures``) do not share the cores with the
    background image build: they wait for it to end."""
    if item.get_closest_marker("failures") and "test_image" in sys.modules:
        sys.modules["test_image"].wait_build()


def pytest_sessionfinish(session):
    if "test_image" in sys.modules:
        sys.modules["test_image"].stop_build()


class ThreadComm(comm.Communicator):
    """Rank ``rank`` of a world of threads; the k-th ``start`` of every rank is summed
    together (matched by order, not name, as MPI does); mismatched sizes fail like MPI
    truncation. With ``partial_gather`` the k-th gather hands out each rank's row as it
    arrives (as MPI's point-to-point diagnosis does); else it is one collective."""

    kind = "threads"

    def __init__(self, shared: dict, rank: int, size: int, partial_gather: bool = True) -> None:
        self.shared, self.rank, self.size, self.calls, self.gathers = shared, rank, size, 0, 0
        self.partial_gather = partial_gather
        self.side_comm: Optional[ThreadComm] = None

    def start_gather(self, row):
        if not self.partial_gather:
            return super().start_gather(row)
        handle, self.gathers = ("gather", self.gathers), self.gathers + 1
        with self.shared["lock"]:
            self.shared.setdefault(handle, {})[self.rank] = np.array(row)
        return handle

    def gathered(self, handle):
        if not self.partial_gather:
            return super().gathered(handle)
        with self.shared["lock"]:
            return dict(self.shared[handle])

    def mark_waiting(self, row, key):
        """Row by row where the gather is (a store's or MPI's point to point), keyed by the
        collective; where the gather is one collective it cannot (``None``)."""
        if not self.partial_gather:
            return None
        handle = ("waiting", key)
        with self.shared["lock"]:
            self.shared.setdefault(handle, {})[self.rank] = np.array(row)
        return handle

    def waiting(self, handle):
        return self.gathered(handle)

    def start(self, buf, name):
        with self.shared["lock"]:
            slots = self.shared.setdefault(self.calls, {})
            slots[self.rank] = np.array(buf, dtype=np.float64)
        self.calls += 1
        return self.calls - 1

    def done(self, handle):
        return len(self.shared.get(handle, {})) == self.size

    def result(self, handle):
        bufs = list(self.shared[handle].values())
        if len({b.shape for b in bufs}) > 1:
            raise RuntimeError("truncated: ranks sent different sizes")
        return np.sum(bufs, axis=0)

    def side(self):
        return self.side_comm

    def subgroup(self, ranks, groups, layer):
        """A world of the threads of ``ranks`` (a BN group), with its own side channel."""
        with self.shared["lock"]:
            main, side = self.shared.setdefault(("group", tuple(ranks)), ({"lock": threading.Lock()},
                                                                           {"lock": threading.Lock()}))
        sub = ThreadComm(main, ranks.index(self.launch_ranks([self.rank])[0]), len(ranks))
        sub.side_comm = ThreadComm(side, sub.rank, sub.size, self.side_comm.partial_gather)
        sub.ranks = list(ranks)
        return sub


def world(size: int, partial_gather: bool = True) -> List[ThreadComm]:
    """One :class:`ThreadComm` per rank of a new world of ``size``, each with a side
    channel (whose gather is row by row, or one collective)."""
    main, side = {"lock": threading.Lock()}, {"lock": threading.Lock()}
    comms = [ThreadComm(main, r, size) for r in range(size)]
    for r, c in enumerate(comms):
        c.side_comm = ThreadComm(side, r, size, partial_gather)
    return comms


def run(size: int, fn: Callable, comms: Optional[List[ThreadComm]] = None, timeout: float = 30.0) -> list:
    """``fn(rank, comm)`` on every rank of ``comms`` (default: a new ``world(size)``), one
    thread each; each rank's result, or the exception it raised (a ``TimeoutError`` for a
    rank still running after ``timeout`` seconds)."""
    comms = world(size) if comms is None else comms
    assert len(comms) == size, f"{len(comms)} communicators for a world of {size}"
    out: list = [None] * size

    def target(r):
        try:
            out[r] = fn(r, comms[r])
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[r] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(timeout=timeout)
        if t.is_alive():
            out[r] = TimeoutError(f"rank {r} still running after {timeout:g} s")
    return out


def results(out: list) -> list:
    """``out`` of :func:`run` when every rank returned; else raise the first rank's error."""
    for r, e in enumerate(out):
        if isinstance(e, BaseException):
            raise AssertionError(f"rank {r} of {len(out)} raised {type(e).__name__}: {e}") from e
    return out


@contextlib.contextmanager
def collective_timeout(seconds: float):
    """SyncBN's collective timeout set to ``seconds`` inside the block, then unset."""
    settings.set_timeout(seconds)
    try:
        yield
    finally:
        settings._timeout = None


def tensorflow():
    """TensorFlow, imported quietly (skips where it is not installed)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


@pytest.fixture
def fake_world():
    """A fake ``torch.distributed`` group of 2 ranks (``torch.testing``'s ``FakeStore``): a
    world without peers, whose all_reduce leaves each buffer as it is."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gloo_world(tmp_path, monkeypatch):
    """A real ``torch.distributed`` group of 1 (Gloo) whose communicator every PyTorch
    SyncBatchNorm gets (alone it would be plain BN): the device path's functional
    collectives with their header, in one process."""
    import torch.distributed as dist

    from hvd_syncbn.torch import SyncBatchNorm, reducers
    from hvd_syncbn.torch.transports import TorchDistComm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        comm = TorchDistComm(None)
        reducers.comm_index(comm)  # as a traced layer's resolution (batchnorm._traced_comm) registers it
        monkeypatch.setattr(SyncBatchNorm, "_comm", lambda self, nccl=False: comm)
        yield comm
    finally:
        dist.destroy_process_group()


@pytest.fixture
def rendezvous(monkeypatch):
    """horovodrun's rendezvous store (the HTTP server it runs for Gloo), in this process,
    and its address in the environment as horovodrun sets it."""
    http_server = pytest.importorskip("horovod.runner.http.http_server")
    server = http_server.RendezvousServer()
    port = server.start()
    server.init([])
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(port))
    yield port
    server.stop()


@pytest.fixture
def rank_tmp():
    """A temporary folder of this process's own. (pytest's ``tmp_path`` keeps one numbered
    base folder and a ``pytest-current`` link per user, which the ranks of a job race to
    make and clean up: once in 20 multi-host runs a rank failed at exit on that link.)"""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@pytest.fixture(params=["composite", "native"])
def kernels(request, monkeypatch):
    """The PyTorch device path on each of its kernel sets (``$HVD_SYNCBN_KERNELS``); the
    native one through ``cuda_kernels.py``'s CPU stand-ins of torch's CUDA-only kernels."""
    import cuda_kernels

    with cuda_kernels.chosen(request.param, monkeypatch):
        yield request.param
