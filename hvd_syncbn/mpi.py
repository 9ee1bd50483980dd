"""MPI through mpi4py: whether this process can use it (:func:`mpi_usable`), whether it
reads CUDA buffers (:func:`mpi_reads_cuda`), and :class:`MpiCommunicator`, its sums and
its point-to-point diagnosis. This module imports no framework, and mpi4py only when used."""

from __future__ import annotations

import ctypes
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from hvd_syncbn.communicator import Communicator
from hvd_syncbn.settings import env_flag


def launched_by_mpirun() -> bool:
    """Whether this process was started by an MPI launcher (Open MPI, MPICH/Hydra, PMIx)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def mpi_usable(expected_size: Optional[int], expected_rank: Optional[int]) -> str:
    """Why the MPI transport cannot be used here ('' if it can)."""
    if not launched_by_mpirun():
        return "not launched by mpirun"
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py is not installed"
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return "MPI was initialised without MPI_THREAD_MULTIPLE"
    world = MPI.COMM_WORLD
    if expected_size is not None and (world.Get_size(), world.Get_rank()) != (expected_size, expected_rank):
        return (f"Horovod's ranks ({expected_rank} of {expected_size}) are not MPI_COMM_WORLD's "
                f"({world.Get_rank()} of {world.Get_size()})")
    return ""


MPI_CUDA_ENV = "HVD_SYNCBN_MPI_CUDA"


def mpi_reads_cuda() -> bool:
    """Whether MPI takes CUDA buffers (CUDA-aware MPI): ``$HVD_SYNCBN_MPI_CUDA`` (0 or 1),
    else what the library says (Open MPI's ``MPIX_Query_cuda_support``, MPICH's
    ``MPIX_GPU_query_support``), else no."""
    if MPI_CUDA_ENV in os.environ:
        return env_flag(MPI_CUDA_ENV, False, "MPI reads host memory only: stage CUDA buffers through the host",
                        "MPI is CUDA-aware: pass it CUDA buffers")
    from mpi4py import MPI

    try:
        lib = ctypes.CDLL(MPI.__file__)  # its symbols and those of the MPI library it links
    except OSError:
        return False
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support())
    if hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        lib.MPIX_GPU_query_support(0, ctypes.byref(supported))  # 0: MPIX_GPU_SUPPORT_CUDA
        return bool(supported.value)
    return False


class MpiCommunicator(Communicator):
    """mpi4py on a duplicate of ``MPI.COMM_WORLD`` (or of a group of it), with a second
    duplicate for diagnostics. ``comm``: use this MPI communicator as it is.

    Sums are MPI's own nonblocking ``Iallreduce`` (in place), polled with ``Test``
    against the deadline: the MPI library picks the algorithm for the network it runs on
    (shared memory, UCX, collective offload). The diagnosis is point to point (every
    rank's row sent to every other, one receive per peer), so the rows of the ranks that
    answer arrive without the others. CUDA buffers (``__cuda_array_interface__``) go to
    MPI as they are where it is CUDA-aware (:func:`mpi_reads_cuda`). Once MPI is
    finalized under a wait (Horovod finalizes the MPI it initialized when a peer shuts it
    down), polls raise instead of calling MPI."""

    kind = "mpi"
    spins = 2000
    partial_gather = True

    def __init__(self, ranks: Optional[List[int]] = None, comm: Any = None, layer: str = "",
                 tag_base: int = 0) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._side: Communicator = self
        self._rounds, self.tag_base = 0, tag_base
        if comm is None:
            world = MPI.COMM_WORLD
            if ranks is None or sorted(ranks) == list(range(world.Get_size())):
                comm, made = world.Idup()
                self._set_up(world, [made], layer)
                side = comm.Dup()  # every rank is here now: one nonblocking duplicate in flight at a time
            else:  # MPI_Comm_create_group has no nonblocking form: it waits for the group's ranks
                self.ranks = sorted(ranks)
                group = world.Get_group().Incl(self.ranks)
                comm, side = world.Create_group(group, tag=1), world.Create_group(group, tag=2)
            self._side = MpiCommunicator(comm=side)
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device_buffers = mpi_reads_cuda()

    def subgroup(self, ranks, groups, layer):
        return MpiCommunicator(ranks, layer=layer)

    def _set_up(self, world: Any, requests: list, layer: str) -> None:
        """Wait for the duplicates of ``world`` (``requests``: ``MPI_Comm_idup``'s), made at
        ``layer``'s first collective, as a collective waits: warning, then raising the
        diagnosis at the timeout (over ``world`` itself, point to point, with tags at the
        top of MPI's range), where a rank's first SyncBN call is on some ranks only."""
        from hvd_syncbn.identity import Call
        from hvd_syncbn.settings import get_timeout
        from hvd_syncbn.waiting import Waiting

        if self._mpi.Request.Testall(requests):
            return
        setup = _Requests(requests, world.Get_rank(), world.Get_size())
        top = world.Get_attr(self._mpi.TAG_UB) or 0
        setup._side = MpiCommunicator(comm=world, tag_base=max(0, top - 2 * TAGS))
        call = Call(layer or "SyncBatchNorm", "setup", 0, 0, 0, "", setup.rank)
        since, timeout = time.monotonic(), get_timeout()
        waiting = Waiting(setup, call, since, timeout)
        try:
            if not setup.wait(requests, since + timeout, waiting):
                from hvd_syncbn.diagnosis import fail

                fail(setup, call, f"MPI's communicators for SyncBN were not made within {timeout:g} s "
                                  f"(HVD_SYNCBN_TIMEOUT): the first SyncBN call of every rank makes them",
                     since=since, stuck=True)
        finally:
            waiting.end()

    def start(self, buf, name):
        # A CUDA buffer (where device_buffers, its stream synchronized by the caller) as it is.
        arr = buf if hasattr(buf, "__cuda_array_interface__") else np.ascontiguousarray(buf, dtype=np.float64)
        return arr, self.comm.Iallreduce(self._mpi.IN_PLACE, arr, op=self._mpi.SUM)

    def start_gather(self, row, tag: Optional[int] = None):
        self._alive()
        if tag is None:
            tag, self._rounds = self.tag_base + self._rounds % TAGS, self._rounds + 1
        row = np.ascontiguousarray(row)
        table = np.zeros((self.size, row.size), dtype=row.dtype)
        table[self.rank] = row
        peers = [r for r in range(self.size) if r != self.rank]
        sends = [self.comm.Isend(row, dest=r, tag=tag) for r in peers]
        return _PeerRows(table, sends, {r: self.comm.Irecv(table[r], source=r, tag=tag) for r in peers})

    def gathered(self, handle):
        self._alive()
        rows = {self.rank: handle.table[self.rank]}
        rows.update({r: handle.table[r] for r, req in handle.receives.items() if req.Test()})
        return rows

    def end_gather(self, handle):
        """Cancels the receives still pending (a cancelled receive completes at once); the
        sends stay with the handle, which :func:`hvd_syncbn.stuck.wait_or_keep` keeps alive."""
        if self._mpi.Is_finalized():
            return
        for req in handle.receives.values():
            if not req.Test():
                req.Cancel()
                req.Wait()

    def mark_waiting(self, row, key):
        """A gather under a tag of the collective's own (a hash of ``key``, above the
        diagnosis's tags: the rounds stay as they are on every rank), where MPI's tags
        reach that far (``MPI_TAG_UB``; else ``None``)."""
        if (self.comm.Get_attr(self._mpi.TAG_UB) or 0) < self.tag_base + 2 * TAGS:
            return None
        return self.start_gather(row, tag=self.tag_base + TAGS + zlib.crc32(key.encode()) % TAGS)

    def waiting(self, handle):
        return self.gathered(handle)

    def end_waiting(self, handle):
        """As :meth:`end_gather`; the sends to the ranks that never came are kept alive."""
        self.end_gather(handle)
        if not all(req.Test() for req in handle.sends):
            from hvd_syncbn.stuck import _orphans

            _orphans.append(handle)

    def done(self, handle):
        if type(handle) is tuple:  # a sum: the normal path, polled thousands of times a wait
            if self._mpi.Is_finalized():
                self._alive()
            return handle[1].Test()
        self._alive()
        return all(req.Test() for req in handle.receives.values())

    def result(self, handle):
        return handle.table.reshape(-1) if isinstance(handle, _PeerRows) else handle[0]

    def side(self):
        return self._side

    def abort(self):
        if not self._mpi.Is_finalized():
            self._mpi.COMM_WORLD.Abort(1)

    def _alive(self) -> None:
        if self._mpi.Is_finalized():
            raise RuntimeError("MPI was finalized while this rank waited (Horovod finalizes the MPI it initialized "
                               "when a peer shuts it down: a peer has exited)")


TAGS = 32767
"""The diagnosis's tags, one per round (32767: the least ``MPI_TAG_UB``), from the
communicator's ``tag_base``; the marks of a waiting rank take the next as many
(:meth:`MpiCommunicator.mark_waiting`)."""


class _Requests(Communicator):
    """The requests that make an :class:`MpiCommunicator`, waited for as a collective (its
    ``side``: a channel over ``MPI_COMM_WORLD``, point to point, with the top of MPI's tags)."""

    kind = "mpi"
    spins = 2000

    def __init__(self, requests: list, rank: int, size: int) -> None:
        self.requests, self.rank, self.size = requests, rank, size
        self._side: Communicator = self

    def done(self, handle):
        return all(req.Test() for req in handle)

    def side(self):
        return self._side

    def abort(self):
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


@dataclass
class _PeerRows:
    """A gather in flight, point to point: the table, this rank's sends, a receive per peer."""

    table: np.ndarray
    sends: list
    receives: dict
