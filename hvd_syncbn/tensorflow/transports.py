"""The TensorFlow transports of :mod:`hvd_syncbn.communicator`: MPI (mpi4py) and Horovod, in :data:`REGISTRY`.

Buffers cross into Python through ``tf.numpy_function``, so both transports get the same
deadline, identity check and diagnosis as in PyTorch. Chosen by :func:`resolve`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from hvd_syncbn.communicator import Communicator, LocalCommunicator
from hvd_syncbn.store_rows import rendezvous_rows
from hvd_syncbn.groups import grouped
from hvd_syncbn.transports import HorovodTransport, MpiTransport, Registry, Request, not_a_member, process_set_of

try:
    import horovod.tensorflow as hvd
    from horovod.common import process_sets as _process_sets
except ImportError:  # pragma: no cover - exercised only where Horovod is missing
    hvd = None

class _Job:
    def __init__(self, fn) -> None:
        self.fn, self.value, self.error, self.event = fn, None, None, threading.Event()


class HorovodComm(Communicator):
    """Horovod's eager allreduce, on a helper thread so that the caller can wait with a
    deadline. Eager Horovod ops all carry one kernel name, so Horovod cannot match them by
    name: one is in flight at a time and they match by order, like MPI (TF runs the
    stateful ``numpy_function`` hops in program order; the identity header checks it).
    Eager ops run inline on the calling thread: no TF thread pool is needed, which
    matters when the pool's one thread is the ``numpy_function`` waiting here."""

    kind = "horovod"

    def __init__(self, process_set: Any, gather: bool = False) -> None:
        self.ps, self.gather = process_set, gather
        self.rank, self.size = process_set.rank(), process_set.size()
        self.ranks = list(process_set.ranks) if process_set.process_set_id else None  # None: all ranks
        self._jobs: "queue.Queue[_Job]" = queue.Queue()
        self._side: Optional[Communicator] = None
        threading.Thread(target=self._serve, daemon=True, name="hvd_syncbn-horovod").start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.value = job.fn()
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                job.error = e
            job.event.set()

    def start(self, buf, name):
        if self.gather:  # the side channel: this rank's row of a (size, k) table, gathered
            row = tf.constant(np.asarray(buf).reshape(self.size, -1)[self.rank : self.rank + 1])
            run = lambda: hvd.allgather(row, process_set=self.ps).numpy().reshape(-1)  # noqa: E731
        else:
            run = lambda: hvd.allreduce(tf.constant(buf), op=hvd.Sum, process_set=self.ps).numpy()  # noqa: E731
        job = _Job(run)
        self._jobs.put(job)
        return job

    def side(self):
        """Under ``horovodrun`` (Gloo), its rendezvous store, row by row
        (:class:`~hvd_syncbn.store_rows.RendezvousRows`); else an allgather, a differently
        named op, so that it passes a stuck allreduce."""
        if self._side is None:
            self._side = (rendezvous_rows(self.rank, self.size, self.ps.process_set_id)
                          or HorovodComm(self.ps, gather=True))
        return self._side

    def done(self, handle):
        return handle.event.is_set()

    def wait(self, handle, deadline, waiting=None):
        """Blocks on the helper's event, waking for ``waiting``'s checks only where it has one due."""
        while True:
            now = time.monotonic()
            until = deadline if waiting is None else min(deadline, waiting.next)
            if handle.event.wait(max(0.0, until - now)):
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            waiting.check(now)

    def result(self, handle):
        if handle.error is not None:
            raise handle.error
        return handle.value

    def abort(self):
        hvd.shutdown()

    def subgroup(self, ranks, groups, layer):
        ps = process_set_of(hvd, ranks, groups, layer)
        return LocalCommunicator(size=1) if ps is None else HorovodComm(ps)

    def reset_error(self, error):
        from hvd_syncbn.elastic import reset_error

        return reset_error(error)


def horovod(what: str) -> Any:
    """``horovod.tensorflow``, or an ``ImportError`` saying that ``what`` needs it."""
    if hvd is None:
        raise ImportError(f"{what} needs Horovod (horovod.tensorflow), which is not installed here; "
                          "launch/install.sh builds it")
    return hvd


def refuse_xla(what: str) -> None:
    """Raise while ``what`` is traced for XLA (``jit_compile=True``): its collectives run
    on the host (``tf.numpy_function``, Horovod's ops), which XLA cannot compile. Checked
    at every world size, so that one rank fails as eight would. (TF has no public test
    for an XLA trace; ``tf.function`` marks one with this context.)"""
    from hvd_syncbn.tensorflow import xla

    if xla.in_xla():
        raise ValueError(
            f"{what} cannot run inside XLA yet (expected jit_compile=False, got a function compiled with "
            "jit_compile=True): its collectives run on the host. Keras 3 turns XLA on by default where a GPU is "
            "listed; pass jit_compile=False to model.compile() or tf.function()")


def resolve_process_set(process_set: Any) -> Any:
    """A registered Horovod process set from ``None`` (all ranks), a set, or its ranks."""
    horovod("a Horovod process set")
    if process_set is None:
        return hvd.global_process_set
    if isinstance(process_set, _process_sets.ProcessSet):
        return process_set
    ranks = sorted(int(r) for r in process_set)
    for set_id, set_ranks in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items():
        if sorted(set_ranks) == ranks:
            return _process_sets._temp_process_set_object(set_id)
    raise ValueError(
        f"expected process_set ranks {ranks} to be a registered Horovod process set; "
        f"register it with hvd.add_process_set({ranks}) or hvd.init(process_sets=...) first"
    )


class HorovodTFTransport(HorovodTransport):
    """Horovod for TensorFlow (:class:`HorovodComm`)."""

    def build(self, request: Request, registry: Registry) -> Communicator:
        return HorovodComm(request.group)


REGISTRY = Registry("TensorFlow", MpiTransport(), HorovodTFTransport())
"""TensorFlow's transports in ``auto``'s order: MPI under mpirun with mpi4py, then Horovod."""


@tf.autograph.experimental.do_not_convert  # plain Python (MPI, Horovod): nothing for AutoGraph to trace
def resolve(kind: Any, process_set: Any, layer: str, group_size: Any = None) -> Optional[Communicator]:
    """The communicator for a layer, or ``None`` when this process is alone (plain BN): of
    its BN group where ``group_size`` says (:mod:`hvd_syncbn.groups`)."""
    hvd_on = hvd is not None and hvd.is_initialized()
    ps = resolve_process_set(process_set) if hvd_on and not isinstance(kind, Communicator) else None
    if ps is not None and not ps.included():
        raise not_a_member(layer, hvd.rank(), ps.ranks)
    request = Request(layer, (hvd.size(), hvd.rank()) if hvd_on else None, False, ps,
                                 None if ps is None else ps.process_set_id, None if ps is None else list(ps.ranks))
    comm = REGISTRY.resolve(kind, request)
    if ps is None and process_set is not None and not isinstance(kind, Communicator):  # ranks, over MPI
        return _ranks_of(comm, sorted(int(r) for r in process_set), layer)
    return grouped(comm, group_size, layer)


def _ranks_of(world: Optional[Communicator], ranks: list, layer: str) -> Optional[Communicator]:
    """The communicator of ``ranks`` of ``world`` (without Horovod: MPI's), made once."""
    if world is None:
        return None
    if world.rank not in ranks:
        raise not_a_member(layer, world.rank, ranks)
    if len(ranks) == 1:
        return None
    made = world.__dict__.setdefault("_sets", {})
    if tuple(ranks) not in made:
        made[tuple(ranks)] = world.subgroup(ranks, [ranks], layer) if len(ranks) < world.size else world
    return made[tuple(ranks)]
