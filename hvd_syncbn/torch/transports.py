"""The PyTorch transports of :mod:`hvd_syncbn.comm`: ``torch.distributed``, MPI (mpi4py)
and Horovod, registered in that order (``auto``'s) in :data:`REGISTRY`.

Chosen per layer call by :func:`resolve`.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvd_syncbn.comm import Communicator, LocalCommunicator
from hvd_syncbn.transports import (
    COMM_ENV, HorovodTransport, MpiTransport, Registry, Request, Transport, not_a_member, rendezvous_rows,
    requested_kind,
)
from hvd_syncbn.torch import private_group

try:
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - exercised only where Horovod is missing
    hvd = None


class HorovodComm(Communicator):
    """Horovod's allreduce, in place: on a numpy buffer (as a CPU tensor) or a tensor,
    CUDA tensors too where Horovod was built with GPU support (over NCCL where built
    with ``HOROVOD_GPU_OPERATIONS=NCCL``)."""

    kind = "horovod"

    def __init__(self, process_set: Any) -> None:
        self.ps = process_set
        self.rank, self.size = process_set.rank(), process_set.size()
        # Built without GPU support, Horovod refuses CUDA tensors (its ready event needs CUDA).
        self.device_buffers = bool(hvd.cuda_built() or hvd.rocm_built())
        self._side = rendezvous_rows(self.rank, self.size, process_set.process_set_id) or self

    def side(self):
        """Under ``horovodrun`` (Gloo), its rendezvous store, row by row
        (:class:`~hvd_syncbn.transports.RendezvousRows`); else Horovod, one collective."""
        return self._side

    def start(self, buf, name):
        tensor = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)
        return buf, hvd.allreduce_async_(tensor, op=hvd.Sum, name=name, process_set=self.ps)

    def done(self, handle):
        return hvd.poll(handle[1])

    def result(self, handle):
        hvd.synchronize(handle[1])
        return handle[0]

    def abort(self):
        hvd.shutdown()


class TorchDistComm(Communicator):
    """``torch.distributed`` on ``group`` (``None``: the default group), with a second
    group of the same ranks for diagnostics (``diagnostics=True``: this is that one).
    Buffers cross on the device the group's backend works on (CUDA for NCCL)."""

    kind = "torch"
    traceable = True

    def __init__(self, group: Any, diagnostics: bool = False) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.size = self.group.rank(), self.group.size()
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._side: Communicator = self
        if not diagnostics:
            ranks = dist.get_process_group_ranks(self.group)
            self._side = TorchDistComm(dist.new_group(ranks, use_local_synchronization=True), diagnostics=True)

    def start(self, buf, name):
        tensor = torch.from_numpy(buf).to(self.device)
        # The group's own method: a private group is not in torch.distributed's tables.
        return tensor, self.group.allreduce([tensor], op=dist.ReduceOp.SUM)

    def done(self, handle):
        return handle[1].is_completed()

    def result(self, handle):
        handle[1].wait()
        return handle[0].cpu().numpy()

    def side(self):
        return self._side


class PrivateGroupComm(TorchDistComm):
    """``torch.distributed`` on a private group of ``over``'s ranks
    (:mod:`hvd_syncbn.torch.private_group`), built over ``over`` (MPI or Horovod), which
    also carries the diagnosis and stops the job after a stuck collective. Host buffers
    cross over Gloo; the device path's CUDA tensors over NCCL."""

    def __init__(self, over: Communicator) -> None:  # not TorchDistComm's: it asks torch's tables
        self.group, self._store = private_group.build(over)
        self.rank, self.size, self.over = over.rank, over.size, over
        self.device = torch.device("cpu")
        atexit.register(self._close)

    def _close(self) -> None:
        """At exit, while Python still runs: destroy the group, joining Gloo's worker threads.
        Left to the interpreter's teardown, a worker that frees the last collective's Python
        objects then aborts the process (``terminate called without an active exception``,
        signal 6: 1 in 4 runs of a 2-rank job on this 2-core machine under load)."""
        if self.group is not None:
            private_group.release(self.group)
            self.group = self._store = None

    def side(self):
        return self.over.side()

    def abort(self):
        self.over.abort()


class TorchTransport(Transport):
    """``torch.distributed``: the default group (or the layer's ``process_set`` as a
    group); asked for by name with no process group, a private group over what ``auto``
    picks among the others (:mod:`hvd_syncbn.torch.private_group`)."""

    name, chosen_because = "torch", "a torch.distributed process group exists"

    def auto_unavailable(self, request: Request) -> Optional[str]:
        return None if request.process_group else "no torch.distributed process group"

    def build(self, request: Request, registry: Registry) -> Communicator:
        group, layer = request.group, request.layer
        if not request.process_group:
            return _private_over_auto(request, registry)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"{layer}: with comm='torch', expected process_set to be a torch.distributed "
                f"ProcessGroup (from dist.new_group), got {type(group).__name__}"
            )
        if group is not None and dist.get_rank(group) < 0:
            raise not_a_member(layer, dist.get_rank(), dist.get_process_group_ranks(group))
        return TorchDistComm(group)


class HorovodTorchTransport(HorovodTransport):
    """Horovod for torch tensors (:class:`HorovodComm`)."""

    def build(self, request: Request, registry: Registry) -> Communicator:
        return HorovodComm(request.group if request.group is not None else hvd.global_process_set)


REGISTRY = Registry("PyTorch", TorchTransport(), MpiTransport(), HorovodTorchTransport())


def private_comm(over: Communicator, why: str) -> PrivateGroupComm:
    """The private group over ``over``, built on first use, once per communicator
    (``why``: for the log line that names the transport)."""
    return REGISTRY.cached(("private", id(over)), lambda: PrivateGroupComm(over),
                           f"{why}: a torch.distributed group of its own, bootstrapped over {over.kind}")


def _private_over_auto(request: Request, registry: Registry) -> Communicator:
    """``comm='torch'`` with no process group: a private one over the transport ``auto``
    picks (MPI or Horovod); alone (one rank) a communicator of one."""
    over, why = registry.choose("auto", request)
    if not private_group.enabled():
        over, why = None, f"{private_group.ENV}=0"
    if over is None:
        raise RuntimeError(
            f"{request.layer}: comm='torch' needs torch.distributed.init_process_group() first, or a job started "
            f"by mpirun (with mpi4py) or horovodrun (after hvd.init()) to build a private group over ({why})")
    over = registry.resolve("auto", request)
    return LocalCommunicator(size=1) if over is None else private_comm(over, "comm='torch' with no process group")


_resolved: dict = {}
_horovod_seen = False


def _horovod_on() -> bool:
    """Whether ``hvd.init()`` has run; once it has, that is remembered (every layer asks
    on every forward, and the ctypes call is slow right after a collective)."""
    global _horovod_seen
    if not _horovod_seen:
        _horovod_seen = hvd is not None and bool(hvd.is_initialized())
    return _horovod_seen


def resolve(kind: Any, process_set: Any, layer: str, nccl: bool = False) -> Optional[Communicator]:
    """The communicator a layer uses now, or ``None`` when it is alone (plain BN).
    ``nccl``: the statistics are CUDA tensors on the device path, which under ``auto`` a
    private group carries over NCCL instead of MPI or Horovod (unless
    ``$HVD_SYNCBN_PRIVATE_GROUP=0``); ``comm='mpi'`` or ``'horovod'`` keeps that transport.

    Called on every forward: the answer is remembered for the state it depends on.
    """
    if isinstance(kind, Communicator):  # the user's, as it is (never remembered by id: ids are reused)
        return kind if kind.size > 1 else None
    hvd_on = _horovod_on()
    state = (kind, os.environ.get(COMM_ENV), hvd_on,
             dist.is_available() and dist.is_initialized(), _set_key(process_set), nccl,
             os.environ.get(private_group.ENV))
    if state not in _resolved:
        comm = REGISTRY.resolve(kind, _request(process_set, layer, hvd_on))
        if nccl and comm is not None and comm.kind in ("mpi", "horovod") and dist.is_nccl_available() \
                and private_group.enabled() and requested_kind(kind) == "auto":
            comm = private_comm(comm, "CUDA tensors on the device path")
        _resolved[state] = comm
    return _resolved[state]


def _request(process_set: Any, layer: str, hvd_on: bool) -> Request:
    if hvd_on and isinstance(process_set, hvd.ProcessSet) and not process_set.included():
        raise not_a_member(layer, hvd.rank(), process_set.ranks)
    pg_exists = dist.is_available() and dist.is_initialized()  # in the key: comm='torch' is a private group without
    return Request(layer, (hvd.size(), hvd.rank()) if hvd_on else None, pg_exists, process_set,
                   (_set_key(process_set), pg_exists), _ranks(process_set))


def _set_key(process_set: Any) -> Any:
    if process_set is None:
        return None
    if hvd is not None and isinstance(process_set, hvd.ProcessSet):
        return ("hvd", process_set.process_set_id)
    return ("obj", id(process_set))


def _ranks(process_set: Any) -> Optional[list]:
    """The world ranks of a Horovod process set or a ``torch.distributed`` group."""
    if process_set is None:
        return None
    if isinstance(process_set, dist.ProcessGroup):
        return dist.get_process_group_ranks(process_set)
    return list(process_set.ranks)
