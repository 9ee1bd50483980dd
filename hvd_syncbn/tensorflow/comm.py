"""The TensorFlow transports of :mod:`hvd_syncbn.comm`: Horovod and MPI (mpi4py).

Buffers cross into Python through ``tf.numpy_function`` (about 35 µs), so both
transports get the same deadline, identity check and diagnosis as in PyTorch. Chosen by
:func:`resolve`: the ``comm`` argument, else ``$HVD_SYNCBN_COMM``, else ``auto``: MPI
when launched by mpirun with mpi4py (and Horovod numbering ranks as
``MPI_COMM_WORLD``), else Horovod.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, List, Optional

import numpy as np

from hvd_syncbn import comm as base

try:
    import horovod.tensorflow as hvd
    from horovod.common import process_sets as _process_sets
except ImportError:  # pragma: no cover - exercised only where Horovod is missing
    hvd = None

def prepend(head: List[float], buf: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(head, dtype=np.float64), buf])


class _Job:
    def __init__(self, fn) -> None:
        self.fn, self.value, self.error, self.event = fn, None, None, threading.Event()


class HorovodComm(base.Communicator):
    """Horovod's allreduce op, run on helper threads so that the caller can wait with a
    deadline and collectives that TF runs concurrently still negotiate by name. (Eager
    Horovod ops all carry one kernel name, so each collective is a small ``tf.function``.)"""

    kind = "horovod"
    THREADS = 4

    def __init__(self, process_set: Any) -> None:
        self.ps = process_set
        self.rank, self.size = process_set.rank(), process_set.size()
        self._jobs: "queue.Queue[_Job]" = queue.Queue()
        self._fns: dict = {}
        for _ in range(self.THREADS):
            threading.Thread(target=self._serve, daemon=True, name="hvd_syncbn-horovod").start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.value = job.fn()
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                job.error = e
            job.event.set()

    def _op(self, name: str, size: int):
        import tensorflow as tf

        if (name, size) not in self._fns:
            self._fns[name, size] = tf.compat.v1.wrap_function(
                lambda t: hvd.allreduce(t, op=hvd.Sum, name=name, process_set=self.ps, ignore_name_scope=True),
                [tf.TensorSpec([size], tf.float64)],
            )
        return self._fns[name, size]

    def start(self, buf, name):
        op = self._op(name, len(buf))
        job = _Job(lambda: op(buf).numpy())
        self._jobs.put(job)
        return job

    def done(self, handle):
        return handle.event.is_set()

    def result(self, handle):
        if handle.error is not None:
            raise handle.error
        return handle.value

    def abort(self):
        hvd.shutdown()


def resolve_process_set(process_set: Any) -> Any:
    """A registered Horovod process set from ``None`` (all ranks), a set, or its ranks."""
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


def resolve(kind: Any, process_set: Any, layer: str) -> Optional[base.Communicator]:
    """The communicator for a layer, or ``None`` when this process is alone (plain BN)."""
    hvd_on = hvd is not None and hvd.is_initialized()
    want, why = base.choose(kind, (hvd.size(), hvd.rank()) if hvd_on else None)
    if want == "torch":
        raise ValueError(f"{layer}: comm='torch' is PyTorch's; with TensorFlow use 'horovod', 'mpi' or 'auto'")
    if not isinstance(want, str):
        return want if want is not None and want.size > 1 else None
    ps = resolve_process_set(process_set) if hvd_on else None
    if hvd_on and not ps.included():
        raise ValueError(f"{layer}: this rank ({hvd.rank()}) is not in the layer's process set {ps.ranks}; "
                         f"build the layer only on member ranks")
    key = (want, "tf", None if ps is None else ps.process_set_id)
    comm = base.cached(key, lambda: _build(want, ps, layer, hvd_on), why)
    return comm if comm.size > 1 else None


def _build(want: str, ps: Any, layer: str, hvd_on: bool) -> base.Communicator:
    if want == "horovod":
        if not hvd_on:
            raise RuntimeError(f"{layer}: comm='horovod' needs hvd.init() first")
        return HorovodComm(ps)
    why = base.mpi_usable(hvd.size() if hvd_on else None, hvd.rank() if hvd_on else None)
    if why:
        raise RuntimeError(f"{layer}: comm='mpi' is not usable here: {why}")
    return base.MpiCommunicator(None if ps is None else list(ps.ranks))
