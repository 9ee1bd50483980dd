"""The PyTorch transports of :mod:`hvd_syncbn.communicator`: ``torch.distributed``, MPI (mpi4py)
and Horovod, registered in that order (``auto``'s) in :data:`REGISTRY`.

Chosen per layer call by :func:`resolve`.
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvd_syncbn.communicator import Communicator, LocalCommunicator
from hvd_syncbn.diagnosis import fail
from hvd_syncbn.groups import grouped
from hvd_syncbn.identity import Call
from hvd_syncbn.settings import TIMEOUT_ENV, collective_timeout, get_timeout
from hvd_syncbn.store_rows import KeyValueRows, rendezvous_rows
from hvd_syncbn.transports import (
    COMM_ENV, HorovodTransport, MpiTransport, Registry, Request, Transport, not_a_member, process_set_of,
    requested_kind,
)
from hvd_syncbn.torch import private_group
from hvd_syncbn.waiting import blocking, unblocked

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
        self.ranks = list(process_set.ranks) if process_set.process_set_id else None  # None: all ranks
        # Built without GPU support, Horovod refuses CUDA tensors (its ready event needs CUDA).
        self.device_buffers = bool(hvd.cuda_built() or hvd.rocm_built())
        self._side = rendezvous_rows(self.rank, self.size, process_set.process_set_id) or self

    def side(self):
        """Under ``horovodrun`` (Gloo), its rendezvous store, row by row
        (:class:`~hvd_syncbn.store_rows.RendezvousRows`); else Horovod, one collective."""
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

    def reset_error(self, error):
        from hvd_syncbn.elastic import reset_error

        return reset_error(error)

    def subgroup(self, ranks, groups, layer):
        ps = process_set_of(hvd, ranks, groups, layer)
        return LocalCommunicator(size=1) if ps is None else HorovodComm(ps)


class TorchDistComm(Communicator):
    """``torch.distributed`` over the ranks of ``group`` (``None``: the default group), on a
    group of SyncBN's own over the same ranks (:func:`own_group`, made at the first
    collective by :meth:`set_up`), whose timeout is SyncBN's (:meth:`bound`): Gloo raises
    and NCCL's watchdog fires at the timeout, not at the user's group's (30 min for Gloo,
    10 for NCCL). Buffers cross on the device the group's backend works on (CUDA for
    NCCL); the diagnosis goes through the default group's store, row by row
    (:class:`StoreRows`)."""

    kind = "torch"
    traceable = True

    def __init__(self, group: Any, ranks: Optional[list] = None) -> None:
        users = group if group is not None else dist.group.WORLD
        self.ranks = ranks or dist.get_process_group_ranks(users)  # ranks: a BN group's, of the default group
        self.rank, self.size = self.ranks.index(dist.get_rank()), len(self.ranks)
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.group: Optional[dist.ProcessGroup] = None
        self.seconds = get_timeout()
        self._side = StoreRows(self.rank, self.size, f"setup.{'-'.join(map(str, self.ranks))}")
        atexit.register(self._close)

    def set_up(self, call: Optional[Call], first: bool = False) -> None:
        """Make SyncBN's own group, at the first collective (``call``), waiting the timeout
        (``first`` under ``torch.compile``: more, as a peer may still be compiling). Every
        rank makes it there: a rank whose peers do not come warns, then raises the diagnosis
        naming them (``call`` ``None``: the group's own error)."""
        self.seconds = collective_timeout(first)
        since = time.monotonic()
        waiting = blocking(self, call, since, self.seconds) if call is not None else None
        try:
            self.group = own_group(self.ranks, self.seconds)
        except RuntimeError as e:  # torch's DistStoreError, Gloo's connect errors
            if call is None:
                raise
            fail(self, call, f"SyncBN's own group of ranks {self.ranks} was not made within {self.seconds:g} s "
                             f"({TIMEOUT_ENV}): every rank makes it at its first SyncBN collective "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", since=since,
                 cause=e)
        finally:
            if waiting is not None:
                unblocked(waiting)
        self._side.group = self.group.group_name

    def prepare(self, call):
        if self.group is None:
            self.set_up(call)

    def subgroup(self, ranks, groups, layer):
        return TorchDistComm(None, ranks)

    def _close(self) -> None:
        """At exit, while Python still runs: destroy the group (if the script has not) and
        drop it, which joins Gloo's worker threads. Left to the interpreter's teardown, a
        worker that frees the last collective's Python objects aborts the process
        (``terminate called without an active exception``, signal 6, in some runs of a
        2-rank torchrun job on a 2-core CPU, with or without ``destroy_process_group()``)."""
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except (ValueError, RuntimeError, AssertionError):  # destroyed already, with the default group
                pass
            self.group = None

    def bound(self, first: bool) -> None:
        """Set the group's timeout for its next collective
        (:func:`~hvd_syncbn.settings.collective_timeout`); a call only when it changes."""
        seconds = collective_timeout(first)
        if seconds != self.seconds:
            try:
                self.group.set_timeout(datetime.timedelta(seconds=seconds))
            except RuntimeError:  # a backend without timeouts (torch's fake one): it keeps its own
                pass
            self.seconds = seconds

    def start(self, buf, name):
        if self.group is None:
            self.set_up(None)
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


GROUP_DESC = "hvd_syncbn SyncBatchNorm statistics"
"""The description of SyncBN's own groups: NCCL's watchdog names it when it fires."""


def own_group(ranks: list, seconds: float) -> dist.ProcessGroup:
    """A group of ``ranks`` for SyncBN's collectives alone, waiting ``seconds``; only ``ranks``
    take part in making it (every one of them, in the same order of first SyncBN calls).
    Costs: one more group of the same backend (Gloo: a connection to each peer and a
    worker thread; NCCL: a communicator and its buffers on the GPU, set up at the first
    collective)."""
    args = dict(timeout=datetime.timedelta(seconds=seconds), use_local_synchronization=True)
    if "group_desc" in inspect.signature(dist.new_group).parameters:
        args["group_desc"] = GROUP_DESC
    return dist.new_group(ranks, **args)


class StoreRows(KeyValueRows):
    """:class:`~hvd_syncbn.store_rows.KeyValueRows` through the default group's store (a
    ``TCPStore``: torchrun's agent's, which outlives the ranks, or rank 0's), over a
    connection of its own that waits :data:`REQUEST_S` at most (the store's host may be
    the stopped rank), made at the first diagnosis."""

    kind = "the process group's store"
    REQUEST_S = 1.0

    def __init__(self, rank: int, size: int, group: Any) -> None:
        super().__init__(rank, size, group)
        self._store: Any = None

    def _connect(self) -> Any:
        if self._store is None:
            store = dist.distributed_c10d._get_default_store()  # private: the default group's store
            while isinstance(store, dist.PrefixStore):
                store = store.underlying_store
            wait = datetime.timedelta(seconds=self.REQUEST_S)
            if isinstance(store, dist.TCPStore):
                store = dist.TCPStore(store.host, store.port, is_master=False, timeout=wait, wait_for_workers=False)
            self._store = store
        return self._store

    def _put(self, key, raw):
        self._connect().set(key, raw)

    def _get(self, key):
        try:
            store = self._connect()
            return store.get(key) if store.check([key]) else None
        except RuntimeError:  # the store does not answer now
            return None


class PrivateGroupComm(TorchDistComm):
    """``torch.distributed`` on a private group of ``over``'s ranks
    (:mod:`hvd_syncbn.torch.private_group`), built over ``over`` (MPI or Horovod), which
    also carries the diagnosis and stops the job after a stuck collective. Host buffers
    cross over Gloo; CUDA statistics over NCCL."""

    def __init__(self, over: Communicator, layer: str = "private_group") -> None:  # not TorchDistComm's
        compiling = torch.compiler.is_compiling()
        self.group, self._store = private_group.build(over, layer, compiling)
        self.rank, self.size, self.ranks, self.over = over.rank, over.size, over.ranks, over
        self.device = torch.device("cpu")
        self.seconds = collective_timeout(compiling)  # as build() set it
        atexit.register(self._close)

    def _close(self) -> None:
        """At exit: as :meth:`TorchDistComm._close`, for a group not in torch's tables."""
        if self.group is not None:
            private_group.release(self.group)
            self.group = self._store = None

    def side(self):
        return self.over.side()

    def abort(self):
        self.over.abort()

    def subgroup(self, ranks, groups, layer):
        over = self.over.subgroup(ranks, groups, layer)
        return over if over.size == 1 else private_comm(over, "a BN group", layer)


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


def private_comm(over: Communicator, why: str, layer: str = "private_group") -> PrivateGroupComm:
    """The private group over ``over``, built on first use (``layer``'s first collective),
    once per communicator (``why``: for the log line that names the transport)."""
    return REGISTRY.cached(("private", id(over)), lambda: PrivateGroupComm(over, layer),
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
    return LocalCommunicator(size=1) if over is None else private_comm(over, "comm='torch' with no process group",
                                                                      request.layer)


_resolved: dict = {}
_horovod_seen = False


def _horovod_on() -> bool:
    """Whether ``hvd.init()`` has run; once it has, that is remembered (every layer asks
    on every forward, and the ctypes call is slow right after a collective)."""
    global _horovod_seen
    if not _horovod_seen:
        _horovod_seen = hvd is not None and bool(hvd.is_initialized())
    return _horovod_seen


def resolve(kind: Any, process_set: Any, layer: str, nccl: bool = False,
            group_size: Any = None) -> Optional[Communicator]:
    """The communicator a layer uses now, or ``None`` when it is alone (plain BN): of its
    BN group where ``group_size`` says (:mod:`hvd_syncbn.groups`).
    ``nccl``: the statistics are CUDA tensors, which under ``auto`` a
    private group carries over NCCL instead of MPI or Horovod (unless
    ``$HVD_SYNCBN_PRIVATE_GROUP=0``); ``comm='mpi'`` or ``'horovod'`` keeps that transport.

    Called on every forward: the answer is remembered for the state it depends on.
    """
    if isinstance(kind, Communicator):  # the user's, as it is (never remembered by id: ids are reused)
        return grouped(kind if kind.size > 1 else None, group_size, layer)
    hvd_on = _horovod_on()
    state = (kind, os.environ.get(COMM_ENV), hvd_on and (hvd.size(), hvd.rank()),  # a new world after a reset
             _world(), _set_key(process_set), nccl,
             os.environ.get(private_group.ENV), group_size)
    if state not in _resolved:
        comm = grouped(REGISTRY.resolve(kind, _request(process_set, layer, hvd_on)), group_size, layer)
        if nccl and comm is not None and comm.kind in ("mpi", "horovod") and dist.is_nccl_available() \
                and private_group.enabled() and requested_kind(kind) == "auto":
            comm = private_comm(comm, "CUDA statistics", layer)
        _resolved[state] = comm
    return _resolved[state]


def _world() -> Any:
    """Which default group exists, if any: a communicator over a destroyed one (whose
    groups of SyncBN's own went with it) is not reused after a new ``init_process_group``."""
    return dist.is_available() and dist.is_initialized() and dist.group.WORLD  # the object: an id is reused


def _request(process_set: Any, layer: str, hvd_on: bool) -> Request:
    if hvd_on and isinstance(process_set, hvd.ProcessSet) and not process_set.included():
        raise not_a_member(layer, hvd.rank(), process_set.ranks)
    world = _world()  # in the key: comm='torch' is a private group without one
    return Request(layer, (hvd.size(), hvd.rank()) if hvd_on else None, bool(world), process_set,
                   (_set_key(process_set), world), _ranks(process_set))


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
