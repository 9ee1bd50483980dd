"""The Keras layer's device path: the statistics stay TF tensors on the input's device,
the collective is a graph op, the checks are deferred flags; no host hop in the step.

The buffers are summed by hvd_syncbn's XLA allreduce over MPI
(:mod:`hvd_syncbn.tensorflow.xla`, CPU), whose wait ends at the timeout: inside XLA
(``jit_compile=True``), and outside it where the layer's transport is MPI (the same
library's TensorFlow kernel; no Horovod cycle to wait for). Otherwise (a GPU
machine, horovodrun) by Horovod's allreduce, NCCL where Horovod has GPU support. Each carries a
static identity header (:func:`hvd_syncbn.identity.static_header`): where the ranks summed
different collectives the buffer comes back NaN, which the checks read as the mismatch
flag. The flags (:mod:`hvd_syncbn.deferred`) accumulate in each layer's
``_sync_errors`` variable; :func:`check` and :class:`CheckSyncBatchNorm` raise them.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence, Tuple

import keras
import tensorflow as tf

from hvd_syncbn.communicator import Communicator
from hvd_syncbn.diagnosis import fail
from hvd_syncbn.identity import HEADER, Call, make_call, static_header
from hvd_syncbn.settings import get_timeout
from hvd_syncbn.waiting import Waiting
from hvd_syncbn.deferred import FLAGS, raise_seen
from hvd_syncbn.tensorflow import transports, xla
from hvd_syncbn.mpi import MpiCommunicator


class DeferredChecks:
    """:class:`hvd_syncbn.backend.Checks` that keep flags as boolean tensors for
    :meth:`record`; a NaN global count marks a mismatched collective (:class:`GraphReducer`)."""

    def __init__(self) -> None:
        self.flags: dict = {}

    def require(self, ok: tf.Tensor, check: str, message: str) -> None:
        self.flags[check] = tf.logical_not(ok)

    def after(self, values: Sequence[tf.Tensor]) -> Sequence[tf.Tensor]:
        self.flags["mismatch"] = tf.math.is_nan(values[0][0])
        return values

    def record(self, errors: tf.Variable) -> None:
        """Count this step's flags into ``errors`` (a layer's ``_sync_errors``, in the order
        of :data:`~hvd_syncbn.deferred.FLAGS`; a check that did not run adds 0)."""
        errors.assign_add(_counts(self.flags))


def _counts(flags: dict) -> tf.Tensor:
    """Boolean scalar ``flags`` by name as a float32 vector in the order of
    :data:`~hvd_syncbn.deferred.FLAGS` (0 where absent): float32, as a variable on a GPU
    takes it (TF has no GPU kernel that adds to an int32 one)."""
    return tf.cast(tf.stack([flags.get(name, False) for name in FLAGS]), tf.float32)


class GraphReducer:
    """Sums a float64 buffer over the ranks of ``comm``'s group by a graph op behind a
    static header; a header that does not sum up makes the buffer NaN. Inside XLA, and
    where ``comm`` is MPI on the CPU, :func:`hvd_syncbn.tensorflow.xla.checked_allreduce`
    sums and checks the header itself; else Horovod's allreduce sums and the graph checks
    the header. The forward's
    NaN is recorded by the layer's checks (:meth:`DeferredChecks.after`); the backward
    sets the mismatch flag in ``errors`` (the layer's ``_sync_errors``) itself.

    A rank whose shard is statically empty has a constant buffer, and Grappler folds
    constants through Horovod's op (it is not stateful): the collective would run while
    the graph is optimized, not in the step. On that path the header therefore takes a
    read of ``errors`` (times zero), which no optimizer folds (hvd_syncbn's allreduce is
    stateful and needs none); and recording the backward's flag keeps its collective,
    whose result such a rank otherwise only needs for an empty input gradient, in the step."""

    def __init__(self, comm: Communicator, process_set: Any, layer: str, channels: int, ndim: int, dtype: str,
                 errors: tf.Variable) -> None:
        self.comm, self.process_set, self.errors = comm, process_set, errors
        self.identity = (layer, channels, ndim, dtype)

    def __call__(self, buf: tf.Tensor, direction: str) -> tf.Tensor:
        layer, size = self.identity[0], self.comm.size
        head = static_header(layer, direction, *self.identity[1:], size)
        buf, name = tf.cast(buf, tf.float64), self._call(direction, -1).name
        if self._ours():  # the library checks the header, and has a failure diagnosed
            mpi = self._mpi(layer)
            xla.on_failure(name, mpi, functools.partial(self._diagnose, direction))
            xla.on_slow(name, mpi, functools.partial(self._waiting, direction))
            summed, mixed = xla.checked_allreduce(buf, name, head, comm=mpi, timeout=get_timeout())
        else:
            start = tf.constant(head, tf.float64) + tf.cast(self.errors[0], tf.float64) * 0.0  # see the class
            out = self._horovod_sum(tf.concat([start, buf], 0), name)
            mixed = tf.reduce_any(tf.not_equal(out[:HEADER], tf.constant([size * h for h in head], tf.float64)))
            summed = tf.where(mixed, tf.constant(float("nan"), tf.float64), out[HEADER:])
        if direction == "fwd":
            return summed
        with tf.control_dependencies([self.errors.assign_add(_counts({"mismatch": mixed}))]):
            return tf.identity(summed)

    def _call(self, direction: str, step: int) -> Call:
        """This layer's collective in ``direction`` at ``step``, on this rank."""
        return Call(self.identity[0], direction, step, *self.identity[1:], self.comm.rank)

    def _diagnose(self, direction: str, step: int, since: float, reason: str) -> None:
        """Raise the diagnosis of this layer's ``step``-th collective in ``direction``, which
        began at ``since`` and failed (:func:`hvd_syncbn.diagnosis.fail`, as on the host path)."""
        fail(self.comm, self._call(direction, step), reason, since=since, stuck=True)

    def _waiting(self, direction: str, step: int, since: float) -> Waiting:
        """The :class:`~hvd_syncbn.waiting.Waiting` of this layer's ``step``-th collective in
        ``direction``, waiting since ``since`` (it warns, as on the host path)."""
        return Waiting(self.comm, self._call(direction, step), since)

    def next_call(self, direction: str) -> Call:
        """This rank's next collective in ``direction`` as the diagnosis describes it: its
        step the library's count where the library sums, else :func:`~hvd_syncbn.identity.make_call`'s."""
        if not self._ours():
            return make_call(self.comm, self.identity[0], direction, *self.identity[1:])
        call = self._call(direction, 0)
        call.step = xla.calls(call.name, self._mpi(self.identity[0]))
        return call

    def met(self) -> Tuple[Communicator, Call]:
        """This layer's collective as the diagnosis describes it (traced once: no step, either direction)."""
        return self.comm, self._call("", -1)

    def _ours(self) -> bool:
        """Whether hvd_syncbn's allreduce sums (inside XLA, or ``comm`` MPI where it is built)."""
        return xla.in_xla() or (isinstance(self.comm, MpiCommunicator) and xla.available() is None)

    def _horovod_sum(self, full: tf.Tensor, name: str) -> tf.Tensor:
        layer = self.identity[0]
        hvd = transports.horovod(f"{layer}: the device path (stats='device') outside XLA")
        if not hvd.is_initialized():
            raise RuntimeError(f"{layer}: the device path (stats='device') sums with Horovod's graph op outside "
                               "XLA; call hvd.init() first, or use stats='host'")
        ps = getattr(self.comm, "ps", None) or transports.resolve_process_set(self.process_set)
        return hvd.allreduce(full, op=hvd.Sum, name=name, process_set=ps)

    def _mpi(self, layer: str) -> Any:
        """The mpi4py communicator of the layer's group, for the XLA allreduce."""
        if isinstance(self.comm, MpiCommunicator):
            return self.comm.comm
        if self.process_set is None and self.comm.ranks is None:
            return xla.default_comm()
        group = f"process set ({self.process_set!r})" if self.process_set is not None else f"BN group {self.comm.ranks}"
        raise ValueError(f"{layer}: inside XLA the statistics travel over MPI; a Horovod {group} needs comm='mpi' "
                         f"under mpirun")


def _sync_layers(model: keras.layers.Layer) -> Iterator[keras.layers.Layer]:
    """The layers of ``model`` (itself included, nested ones too) that record flags."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if getattr(layer, "_sync_errors", None) is not None:
            yield layer


def check(model: keras.layers.Layer) -> None:
    """Raise the device path's deferred errors of ``model``'s SyncBatchNormalization
    layers (one host read), naming each layer and what it saw since the last check, and
    clear them.

    Raises:
        SyncBatchNormError: ranks summed different collectives.
        ValueError: a global batch of one row, or non-finite statistics with ``check_finite``.
    """
    layers = list(_sync_layers(model))
    seen = [(layer.name, layer._sync_errors.numpy().astype(bool)) for layer in layers]
    for layer in layers:
        layer._sync_errors.assign(tf.zeros_like(layer._sync_errors))
    mismatched = [layer._sync_reducer for layer, (_, row) in zip(layers, seen) if row[FLAGS.index("mismatch")]]
    raise_seen("SyncBatchNormalization (device path)", seen, mismatched[0].met() if mismatched else None)


class CheckSyncBatchNorm(keras.callbacks.Callback):
    """Raises the device path's deferred errors (:func:`check`) during ``fit``: after
    every ``every_n_batches`` training batches and at the end of each epoch. A check
    reads a few flags from the device: one small sync per check.

    Args:
        every_n_batches: how often to check within an epoch. Default: 1 (every batch).
    """

    def __init__(self, every_n_batches: int = 1) -> None:
        super().__init__()
        if not isinstance(every_n_batches, int) or every_n_batches < 1:
            raise ValueError(f"CheckSyncBatchNorm: expected every_n_batches to be a positive int, "
                             f"got {every_n_batches!r}")
        self.every_n_batches = every_n_batches

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every_n_batches == 0:
            check(self.model)

    def on_epoch_end(self, epoch, logs=None):
        check(self.model)
