"""Which transport carries a layer's statistics, and the MPI one.

A layer's ``comm`` argument (else ``$HVD_SYNCBN_COMM``, else ``auto``) names Horovod, MPI
(mpi4py) or, for PyTorch, ``torch.distributed``; :func:`resolve` builds one communicator
per transport and group of ranks per process. The adapters pass in their framework's
state and builders; this module imports no framework.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from hvd_syncbn.comm import Communicator, env_flag

log = logging.getLogger("hvd_syncbn")

COMM_ENV = "HVD_SYNCBN_COMM"
KINDS = ("auto", "horovod", "mpi", "torch")


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


def choose(kind: Any, horovod: Optional[Tuple[int, int]], process_group: bool = False) -> Tuple[Any, str]:
    """The documented rule: ``(transport, why)`` for a layer's ``comm`` argument.

    ``horovod`` is Horovod's ``(size, rank)`` if initialised; ``process_group`` says
    whether a ``torch.distributed`` default group exists. Under ``auto``: torch if a
    group exists, else MPI if usable, else Horovod, else ``None`` (this process is alone).
    """
    want = requested_kind(kind)
    if want != "auto":
        return want, "requested"
    if process_group:
        return "torch", "a torch.distributed process group exists"
    why = mpi_usable(*(horovod or (None, None)))
    if not why:
        return "mpi", "launched by mpirun with mpi4py"
    return ("horovod" if horovod else None), why


_cache: dict = {}


def _cached(key: Any, build: Callable[[], "Communicator"], why: str) -> "Communicator":
    """One communicator per ``key`` per process; the first one built is logged on rank 0."""
    if key not in _cache:
        _cache[key] = build()
        if len(_cache) == 1 and _cache[key].rank == 0:
            log.warning("hvd_syncbn: statistics travel over %s (%s; set %s to change)", key[0], why, COMM_ENV)
    return _cache[key]


def resolve(kind: Any, layer: str, horovod: Optional[Tuple[int, int]], key: Any, ranks: Optional[List[int]],
            build_horovod: Callable[[], Communicator], build_torch: Optional[Callable[[], Communicator]] = None,
            process_group: bool = False) -> Optional[Communicator]:
    """The communicator for a layer's ``comm`` argument (see :func:`choose`), one per
    transport and ``key`` per process, or ``None`` when this process is alone.

    Args:
        kind: the layer's ``comm`` argument.
        layer: the layer's name, for errors.
        horovod: Horovod's ``(size, rank)`` if initialised, else ``None``.
        key: what identifies the group of ranks (e.g. a process set's id).
        ranks: that group's ranks in ``MPI_COMM_WORLD`` (``None``: all).
        build_horovod, build_torch: make the framework's transports (``build_torch``
            ``None`` where the framework has no such transport).
        process_group: whether a ``torch.distributed`` default group exists.

    Raises ``RuntimeError`` when the requested transport cannot work here, saying why.
    """
    want, why = choose(kind, horovod, process_group)
    if want is None or isinstance(want, Communicator):
        return want if want is not None and want.size > 1 else None
    if want == "horovod" and horovod is None:
        raise RuntimeError(f"{layer}: comm='horovod' needs hvd.init() first")
    if want == "torch" and build_torch is None:
        raise ValueError(f"{layer}: comm='torch' is PyTorch's; with TensorFlow use 'horovod', 'mpi' or 'auto'")
    if want == "mpi":
        unusable = mpi_usable(*(horovod or (None, None)))
        if unusable:
            raise RuntimeError(f"{layer}: comm='mpi' is not usable here: {unusable}")
    builders = {"horovod": build_horovod, "torch": build_torch, "mpi": lambda: MpiCommunicator(ranks)}
    comm = _cached((want, key), builders[want], why)
    return comm if comm.size > 1 else None


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

    Sums are MPI's own nonblocking ``Iallreduce`` (in place), and the diagnosis an
    ``Iallgather``, polled with ``Test`` against the deadline: the MPI library picks the
    algorithm for the network it runs on (shared memory, UCX, collective offload). CUDA
    buffers (``__cuda_array_interface__``) go to MPI as they are where it is CUDA-aware
    (:func:`mpi_reads_cuda`)."""

    kind = "mpi"
    spins = 2000

    def __init__(self, ranks: Optional[List[int]] = None, comm: Any = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._side: Communicator = self
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
        table = np.empty((self.size, row.size), dtype=row.dtype)
        return table, self.comm.Iallgather(np.ascontiguousarray(row), table)

    def done(self, handle):
        return handle[1].Test()

    def result(self, handle):
        return handle[0]

    def side(self):
        return self._side

    def abort(self):
        self._mpi.COMM_WORLD.Abort(1)
