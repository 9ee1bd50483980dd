"""Which transport carries a layer's statistics: a registry per framework, and MPI.

A layer's ``comm`` argument (else ``$HVD_SYNCBN_COMM``, else ``auto``) names a
:class:`Transport` in its framework's :class:`Registry` (or is a :class:`Communicator`
to use as it is). Under ``auto`` the registry takes the first transport, in registration
order, that can work here: for PyTorch ``torch.distributed`` if a process group exists,
then MPI under mpirun with mpi4py, then Horovod after ``hvd.init()``; with none, the
process is alone. The registry builds one communicator per transport and group of ranks
per process. Adding a transport is one :class:`Transport` subclass and one
:meth:`Registry.register`. This module imports no framework.
"""

from __future__ import annotations

import ctypes
import logging
import os
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hvd_syncbn import launchers
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.settings import env_flag

log = logging.getLogger("hvd_syncbn")

COMM_ENV = "HVD_SYNCBN_COMM"
KINDS = ("auto", "horovod", "mpi", "torch")
"""What ``comm`` may name: ``auto`` and every transport any adapter registers."""


def requested_kind(kind: Any) -> Any:
    """The transport asked for: the argument (a name, or a :class:`Communicator` to use
    as it is), else ``$HVD_SYNCBN_COMM``, else ``auto``."""
    if isinstance(kind, Communicator):
        return kind
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"comm: expected one of {', '.join(KINDS)} or a Communicator, got {kind!r}")
    value = (kind or os.environ.get(COMM_ENV) or "auto").lower()
    if value not in KINDS:
        source = "comm" if kind else COMM_ENV
        raise ValueError(f"{source}: expected one of {', '.join(KINDS)}, got {value!r}")
    return value


def launched_by_mpirun() -> bool:
    """Whether this process was started by an MPI launcher (Open MPI, MPICH/Hydra, PMIx)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


@dataclass(frozen=True)
class Request:
    """A layer's request for a communicator, as its adapter sees this process.

    Args:
        layer: the layer's name, for errors.
        horovod: Horovod's ``(size, rank)`` if ``hvd.init()`` has run, else ``None``.
        process_group: whether a ``torch.distributed`` default group exists.
        group: the layer's group of ranks as its framework names it (a Horovod process
            set, a ``torch.distributed`` group), ``None`` for all.
        key: what identifies that group (communicators are built once per transport and key).
        ranks: that group's ranks in ``MPI_COMM_WORLD`` (``None``: all).
    """

    layer: str
    horovod: Optional[Tuple[int, int]] = None
    process_group: bool = False
    group: Any = None
    key: Any = None
    ranks: Optional[List[int]] = None


class Transport:
    """One way statistics travel. Subclasses set :attr:`name` and :attr:`chosen_because`
    and implement :meth:`unavailable` and :meth:`build`; the capability flags live on the
    communicators they build (``device_buffers``, ``traceable``)."""

    name = "?"
    chosen_because = ""
    """Why ``auto`` took it, for the log line."""

    def unavailable(self, request: Request) -> Optional[str]:
        """Why it cannot work here when asked for by name (``None``: it can)."""
        return None

    def auto_unavailable(self, request: Request) -> Optional[str]:
        """Why ``auto`` passes it over (``None``: ``auto`` takes it)."""
        return self.unavailable(request)

    def build(self, request: Request, registry: "Registry") -> Communicator:
        raise NotImplementedError


class MpiTransport(Transport):
    """mpi4py, under an MPI launcher (:class:`MpiCommunicator`)."""

    name, chosen_because = "mpi", "mpi4py under an MPI launcher"

    def unavailable(self, request: Request) -> Optional[str]:
        return mpi_usable(*(request.horovod or (None, None))) or None

    def build(self, request: Request, registry: "Registry") -> Communicator:
        return MpiCommunicator(request.ranks)


class HorovodTransport(Transport):
    """Horovod's allreduce; the adapters build their framework's communicator."""

    name, chosen_because = "horovod", "hvd.init() has run"

    def unavailable(self, request: Request) -> Optional[str]:
        return None if request.horovod else "it needs hvd.init() first"


class Registry:
    """A framework's transports, in ``auto``'s order of preference, and the
    communicators built from them: one per transport and group of ranks per process."""

    def __init__(self, framework: str, *transports: Transport) -> None:
        self.framework = framework
        self.transports: Dict[str, Transport] = {}
        self.built: Dict[Any, Communicator] = {}
        for t in transports:
            self.register(t)

    def register(self, transport: Transport) -> None:
        """Add ``transport`` (after those registered before it, for ``auto``)."""
        self.transports[transport.name] = transport

    def requested(self, kind: Any, layer: str) -> Any:
        """:func:`requested_kind`, refusing a transport this framework does not have."""
        want = requested_kind(kind)
        if isinstance(want, str) and want != "auto" and want not in self.transports:
            names = ", ".join(repr(n) for n in ("auto", *self.transports))
            source = "comm" if kind is not None else f"${COMM_ENV}"
            raise ValueError(f"{layer}: {source}={want!r} is not a {self.framework} transport; "
                             f"with {self.framework} use {names}")
        return want

    def choose(self, kind: Any, request: Request) -> Tuple[Any, str]:
        """``(transport, why)`` for a layer's ``comm``: a :class:`Communicator` as it is, a
        named transport, or under ``auto`` the first that works here (``None`` if none)."""
        want = self.requested(kind, request.layer)
        if isinstance(want, Communicator):
            return want, "requested"
        if want != "auto":
            return self.transports[want], "requested"
        passed = []
        for transport in self.transports.values():
            why = transport.auto_unavailable(request)
            if why is None:
                return transport, "; ".join([transport.chosen_because, *passed])
            passed.append(f"not {transport.name}: {why}")
        return None, "; ".join(passed)

    def resolve(self, kind: Any, request: Request) -> Optional[Communicator]:
        """The communicator for a layer's ``comm`` (see :meth:`choose`), or ``None`` when
        this process is alone. Raises ``RuntimeError`` when the requested transport
        cannot work here, saying why."""
        chosen, why = self.choose(kind, request)
        if chosen is None:
            alone_in_a_launch(request.layer, self.framework, why)
        if chosen is None or isinstance(chosen, Communicator):
            return chosen if chosen is not None and chosen.size > 1 else None
        problem = chosen.unavailable(request)
        if problem:
            raise RuntimeError(f"{request.layer}: comm={chosen.name!r} is not usable here: {problem}")
        comm = self.cached((chosen.name, request.key), lambda: chosen.build(request, self), why)
        return comm if comm.size > 1 else None

    def cached(self, key: Any, build: Callable[[], Communicator], why: str = "") -> Communicator:
        """The communicator built for ``key``, built now if new (the first one logged on rank 0)."""
        if key not in self.built:
            self.built[key] = build()
            if len(self.built) == 1 and self.built[key].rank == 0:
                log.warning("hvd_syncbn: statistics travel over %s (%s; ranks started by %s; set %s to change)",
                            key[0], why, launchers.launcher() or "no launcher", COMM_ENV)
        return self.built[key]


STRICT_ENV = "HVD_SYNCBN_STRICT"
_warned_alone = False


def alone_in_a_launch(layer: str, framework: str, why: str) -> None:
    """A layer found no transport: if a launcher started several processes, this one
    would silently normalise with its own statistics only. Warn once per process, naming
    the launch and what to do; raise ``RuntimeError`` instead under ``$HVD_SYNCBN_STRICT=1``."""
    global _warned_alone
    try:
        size = launchers.world_size()
    except ValueError:  # a malformed launcher variable says nothing reliable about a launch
        return
    if size is None or size < 2:
        return
    strict = env_flag(STRICT_ENV, False, "warn", "raise")
    if _warned_alone and not strict:
        return
    todo = ("call torch.distributed.init_process_group() before training, or hvd.init() (Horovod), or under "
            "mpirun install mpi4py" if framework == "PyTorch"
            else "call hvd.init() (Horovod) first, or under mpirun install mpi4py")
    message = (f"{layer}: this process is one of {size} started by {launchers.launcher()}, but {framework} "
               f"SyncBatchNorm found no transport ({why}), so it normalises with this process's statistics "
               f"only; {todo}")
    if strict:
        raise RuntimeError(f"{message} (an error because {STRICT_ENV}=1)")
    _warned_alone = True
    warnings.warn(f"{message}; set {STRICT_ENV}=1 to make this an error", RuntimeWarning)


def not_a_member(layer: str, rank: int, ranks: Any) -> ValueError:
    """The error for a layer built on a rank outside its process set."""
    return ValueError(f"{layer}: this rank ({rank}) is not in the layer's process set {ranks}; "
                      f"build the layer only on member ranks")


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

    def __init__(self, ranks: Optional[List[int]] = None, comm: Any = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._side: Communicator = self
        self._rounds = 0
        if comm is None:
            world = MPI.COMM_WORLD
            if ranks is None or sorted(ranks) == list(range(world.Get_size())):
                comm, side = world.Dup(), world.Dup()
            else:
                group = world.Get_group().Incl(sorted(ranks))
                comm, side = world.Create_group(group, tag=1), world.Create_group(group, tag=2)
            self._side = MpiCommunicator(comm=side)
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device_buffers = mpi_reads_cuda()

    def start(self, buf, name):
        # A CUDA buffer (where device_buffers, its stream synchronized by the caller) as it is.
        arr = buf if hasattr(buf, "__cuda_array_interface__") else np.ascontiguousarray(buf, dtype=np.float64)
        return arr, self.comm.Iallreduce(self._mpi.IN_PLACE, arr, op=self._mpi.SUM)

    def start_gather(self, row):
        self._alive()
        tag, self._rounds = self._rounds % 32767, self._rounds + 1  # 32767: the least MPI_TAG_UB
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


@dataclass
class _PeerRows:
    """A gather in flight, point to point: the table, this rank's sends, a receive per peer."""

    table: np.ndarray
    sends: list
    receives: dict


RENDEZVOUS_ENV = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")


class KeyValueRows(Communicator):
    """A diagnosis gathered row by row through a key-value store that outlives the ranks'
    collectives: each rank puts its row under its own key and reads the peers' rows as
    they appear, so a stopped or lost rank leaves out only its own. It gathers only (the
    sums stay with the transport). ``group``: what tells this group's rows from another's.
    A store says how to :meth:`_put` and :meth:`_get` a key."""

    partial_gather = True
    SCOPE = "hvd_syncbn_diagnosis"

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group, self._rounds = rank, size, group, 0

    def _key(self, handle: "_StoreRows", rank: int) -> str:
        return f"{self.SCOPE}/{self.group}.{handle.round}.{rank}"

    def _put(self, key: str, raw: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str) -> Optional[bytes]:
        """The value under ``key``, ``None`` if there is none yet (or the store does not answer now)."""
        raise NotImplementedError

    def start_gather(self, row):
        handle = _StoreRows(self._rounds, np.ascontiguousarray(row), {})
        self._rounds += 1
        handle.rows[self.rank] = handle.row
        self._put(self._key(handle, self.rank), handle.row.tobytes())
        return handle

    def gathered(self, handle):
        for rank in range(self.size):
            if rank in handle.rows:
                continue
            raw = self._get(self._key(handle, rank))
            if raw is not None and len(raw) == handle.row.nbytes:
                handle.rows[rank] = np.frombuffer(raw, dtype=handle.row.dtype)
        return dict(handle.rows)

    def done(self, handle):
        return len(self.gathered(handle)) == self.size


class RendezvousRows(KeyValueRows):
    """:class:`KeyValueRows` through ``horovodrun``'s (Gloo) rendezvous store: an HTTP
    server in the ``horovodrun`` process, which lives as long as the job."""

    kind = "horovodrun's rendezvous store"
    REQUEST_S = 1.0

    def __init__(self, rank: int, size: int, group: Any, address: str) -> None:
        super().__init__(rank, size, group)
        self.address = address

    def _put(self, key, raw):
        put = urllib.request.Request(f"{self.address}/{key}", data=raw, method="PUT")
        _NO_PROXY.open(put, timeout=self.REQUEST_S).close()

    def _get(self, key):
        try:
            with _NO_PROXY.open(f"{self.address}/{key}", timeout=self.REQUEST_S) as answer:
                return answer.read()
        except (urllib.error.URLError, OSError):  # 404: not yet; else unreachable: not now
            return None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The store is the launcher's, reached directly (as Horovod's Gloo reaches it), never through ``$http_proxy``."""


@dataclass
class _StoreRows:
    """A gather in flight over the rendezvous store: its round, this rank's row, the rows read."""

    round: int
    row: np.ndarray
    rows: dict


def rendezvous_rows(rank: int, size: int, group: Any) -> Optional[RendezvousRows]:
    """:class:`RendezvousRows` where ``horovodrun`` (Gloo) started this process, else ``None``."""
    addr, port = (os.environ.get(k) for k in RENDEZVOUS_ENV)
    if not addr or not port:
        return None
    host = f"[{addr}]" if ":" in addr else addr
    return RendezvousRows(rank, size, group, f"http://{host}:{port}")
